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


def test_feature_layer_shards_follow_their_sequences_into_batches(tmp_path: Path) -> None:
    """``--layer-feats`` shards (scripts/layer_feats.py) give each sequence its layers' streams,
    cropped with it; a batch's ``prev`` row at t is [f_{t-1}; stream_a(t-1); stream_b(t-1)]
    (zeros at t = 0), the final state alone without them."""
    data, layers = tmp_path / "data", tmp_path / "layers"
    data.mkdir()
    layers.mkdir()
    _shard(data / "broad_000.pt", 3000, [7, 5], [3, 2])
    n = 6 + 4
    aux = torch.stack([torch.arange(n) + 100.0, torch.arange(n) + 200.0], dim=1)  # [positions, 2 layers]
    torch.save({"layers": [1, 2], "feats": aux[:, :, None].expand(n, 2, 4).to(torch.float16)}, layers / "broad_000.pt")
    seqs = train_heads.load_data(data, "broad_*.pt", layers)
    assert [s["aux"].shape for s in seqs] == [(6, 2, 4), (4, 2, 4)]
    assert float(seqs[1]["aux"][0, 0, 0]) == 106.0 and float(seqs[1]["aux"][0, 1, 0]) == 206.0
    cropped = train_heads.crop(seqs, 1)  # the first sequence loses 2 prompt tokens, the second 1
    assert float(cropped[0]["aux"][0, 0, 0]) == 102.0 and float(cropped[1]["aux"][0, 1, 0]) == 207.0
    bt = train_heads.pad_batch(cropped, 4)
    prev = bt["prev"]
    assert prev.shape == (2, 4, 12)
    assert prev[0, 0].abs().sum() == 0  # nothing before the first position
    assert prev[0, 1].tolist() == [3000.0] * 4 + [102.0] * 4 + [202.0] * 4
    assert prev[1, 1].tolist() == [3000.0] * 4 + [107.0] * 4 + [207.0] * 4
    assert train_heads.pad_batch(train_heads.load_data(data, "broad_*.pt"), 4)["prev"].shape[-1] == 4
