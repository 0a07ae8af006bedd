"""scripts/tree_acceptance.py measures static draft trees right: a tree accepts a start's path
as deep as the path's rank tuples stay in the tree, the best tree of N nodes is prefix-closed
and takes the most frequent prefixes, and the ranks come from the head's own distribution
along the greedy path (MISS outside the draft vocabulary)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (tree_acceptance imports train_heads by name, as when run from scripts/)
    spec.loader.exec_module(module)
    return module


train_heads = _script("train_heads")
tree_acceptance = _script("tree_acceptance")
MISS = tree_acceptance.MISS


def test_accepted_length_follows_the_path_while_it_stays_in_the_tree() -> None:
    paths = torch.tensor([[0, 0, 0], [0, 1, 0], [1, 0, 5], [2, 0, 0], [MISS, 0, 0]])
    acc = tree_acceptance.accepted_length
    assert acc(paths, tree_acceptance.chain(1)) == (2 + 2 + 1 + 1 + 1) / 5
    assert acc(paths, tree_acceptance.chain(3)) == (4 + 2 + 1 + 1 + 1) / 5
    tree = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0)]
    assert acc(paths, tree) == (3 + 4 + 3 + 1 + 1) / 5
    assert acc(paths[:0], tree) == 0.0  # (no start: nothing measured)


def test_the_best_tree_is_prefix_closed_and_takes_the_most_frequent_prefixes() -> None:
    paths = torch.tensor([[0, 0, 0]] * 5 + [[0, 1, 0]] * 3 + [[1, 0, 0]] * 2 + [[3, 0, 0]] * 1 + [[9, 0, 0]] * 4)
    best = tree_acceptance.best_tree
    assert best(paths, 1, 8) == [(0,)]
    assert best(paths, 3, 8) == [(0,), (0, 0), (0, 0, 0)]  # 8, 5, 5 beat (0, 1): 3
    tree = best(paths, 8, 8)
    assert all(len(n) == 1 or n[:-1] in tree for n in tree)
    assert set(tree) == {(0,), (0, 0), (0, 0, 0), (0, 1), (0, 1, 0), (1,), (1, 0), (1, 0, 0)}
    assert all(n[0] != 9 for n in best(paths, 20, 8))  # ranks from --max-rank on are never children
    for n in (1, 2, 4, 8):  # the best tree of n nodes accepts at least as much as the chain of n
        assert tree_acceptance.accepted_length(paths, best(paths, n, 8)) >= tree_acceptance.accepted_length(
            paths, tree_acceptance.chain(n)
        )


def test_ranks_are_the_heads_own_along_the_greedy_path() -> None:
    from safetensors.torch import load_file

    from draftwise.worker.model.loader import load_model
    from draftwise.worker.model.rope import RotaryEmbedding
    from draftwise.worker.paths import HEADS_DIR, resolve_model
    from draftwise.worker.speculative.heads import EagleHead, head_model_config

    target = load_model(resolve_model("default"), dtype="float32")
    cfg = target.config
    saved = load_file(str(HEADS_DIR / "default-eagle" / "head.safetensors"))
    draft_ids = saved.pop("draft_ids").long()
    head = EagleHead(head_model_config(cfg))
    head.load_state_dict({k: v.float() for k, v in saved.items()})
    teacher = train_heads.Teacher(target.model, draft_ids)
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, 256)
    g = torch.Generator().manual_seed(0)
    outside = next(t for t in range(cfg.vocab_size) if int(teacher.remap[t]) < 0)
    tokens = draft_ids[torch.randint(0, draft_ids.numel(), (20,), generator=g)].clone()
    tokens[12] = outside  # the target's token at start 11 (depth 1) is never proposed
    seq = {
        "tokens": tokens,
        "feats": torch.randn(19, cfg.hidden_size, generator=g).half(),
        "prompt": 4,
        "temperature": 0.0,
    }
    paths = tree_acceptance.rank_paths(head, teacher, rope, [seq], depth=3)
    # answer positions 3..18 (each predicts the next token), 3 deep: starts 3..16
    assert paths.shape == (14, 3)
    assert int(paths[11 - 3, 0]) == MISS and int(paths[10 - 3, 1]) == MISS and int(paths[9 - 3, 2]) == MISS
    with torch.no_grad():  # depth 1 is the head's first pass over the real features
        bt = train_heads.pad_batch([seq], cfg.hidden_size)
        lg = teacher.logits(head.train_forward(teacher.emb[bt["x"]], bt["prev"], rope))[0]
    for s in range(3, 17):
        want = int(teacher.remap[tokens[s + 1]])
        if want >= 0:
            assert int(paths[s - 3, 0]) == int((lg[s] > lg[s, want]).sum())
