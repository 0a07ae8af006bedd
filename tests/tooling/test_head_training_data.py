"""scripts/train_heads.py reads its data right: the held-out shard (``shard_000.pt``) is never
trained on, whatever other shards lie beside it (generated ``shard_NNN``, broad ``broad_NNN``,
teacher-forced ``text_NNN``; a broad shard sorts first, which once put the held-out answers
into training), and each sequence keeps its tokens, features and prompt length."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("train_heads", ROOT / "scripts" / "train_heads.py")
assert spec is not None and spec.loader is not None
train_heads = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_heads)


def _shard(path: Path, first_token: int, lengths: list[int], prompts: list[int]) -> None:
    tokens = torch.arange(first_token, first_token + sum(lengths), dtype=torch.int32)
    feats = torch.full((sum(n - 1 for n in lengths), 4), float(first_token), dtype=torch.float16)
    torch.save(
        {
            "tokens": tokens,
            "feats": feats,
            "lengths": lengths,
            "prompt_lengths": prompts,
            "kinds": ["x"] * len(lengths),
            "temperatures": [0.0] * len(lengths),
        },
        path,
    )


def test_the_held_out_shard_is_never_trained_on(tmp_path: Path) -> None:
    _shard(tmp_path / "shard_000.pt", 1000, [5, 6], [2, 3])
    _shard(tmp_path / "shard_001.pt", 2000, [4], [1])
    _shard(tmp_path / "broad_000.pt", 3000, [7, 3], [2, 1])
    _shard(tmp_path / "text_000.pt", 4000, [5], [2])
    _shard(tmp_path / "eval_000.pt", 5000, [5], [2])  # evaluation answers written into the same folder by mistake
    held_out = train_heads.load_data(tmp_path, train_heads.HELD_OUT)
    train = train_heads.training_data(tmp_path)
    assert [int(s["tokens"][0]) for s in held_out] == [1000, 1005]
    firsts = sorted(int(s["tokens"][0]) for s in train)
    assert firsts == [2000, 3000, 3007, 4000]  # everything else, and nothing of shard_000
    by_first = {int(s["tokens"][0]): s for s in train}
    assert by_first[3007]["broad"] and not by_first[2000]["broad"]
    assert by_first[4000]["source"] == "text" and by_first[3000]["source"] == "generated"
    s = by_first[3000]
    assert s["tokens"].tolist() == list(range(3000, 3007)) and s["prompt"] == 2
    assert s["feats"].shape == (6, 4) and float(s["feats"][0, 0]) == 3000.0
