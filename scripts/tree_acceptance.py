"""What tree drafting would give an EAGLE head at temperature 0, measured before building it.

At temperature 0 a drafted tree is accepted along the target's own greedy path: depth ``d`` is
accepted when the path's first ``d`` tokens are all nodes of the tree. Along that path the head
reads exactly what drafting would (the real tokens' embeddings and its own features, as in
training-time test), so one run of the head over the target's greedy answers gives, for every
start position, the *rank* of the target's token in the head's draft distribution at each depth:
a tuple ``(r1, ..., rD)``. A static tree is a prefix-closed set of such rank tuples (node
``(0, 1)``: the second-best child of the best first token); its mean accepted length on a set of
answers is ``1 + mean(#tree nodes on each start's tuple path)``, and the best tree of ``N`` nodes
for a set is its ``N`` most frequent tuple prefixes (a prefix is never rarer than its extensions).
The chain of ``k`` drafts is the tree ``{(0,), (0, 0), ...}``.

The tree is chosen on one set of answers (``--choose-data``: the head's training data) and
measured on another (``--eval-data``: the target's answers to the held-out evaluation prompts,
``distill_heads_data.py --prompts eval``), so the figures are not fitted to what they measure.
Verifying a tree of ``N`` nodes is one target pass over ``N + 1`` rows (a tree attention mask);
drafting it takes as many head passes as it is deep, each over that depth's nodes.

    python scripts/tree_acceptance.py --model smollm2-135m-instruct \\
        --choose-data .cache/heads/smollm2/data --eval-data .cache/heads/smollm2/eval
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file
from train_heads import Teacher, batches, crop, load_data, pad_batch

from draftwise.worker.model.loader import load_model
from draftwise.worker.model.rope import RotaryEmbedding
from draftwise.worker.paths import HEADS_DIR, resolve_model
from draftwise.worker.speculative.heads import EagleHead, HeadConfig, head_model_config

MISS = 1 << 30
"""The rank of a token outside the draft vocabulary: never proposed."""


def rank_paths(head: EagleHead, teacher: Teacher, rope: RotaryEmbedding, seqs: list[dict], depth: int) -> torch.Tensor:
    """[starts, depth] int64: for each start position of each greedy answer whose next ``depth``
    tokens are all in it, the rank of the target's token at each depth in the head's draft
    distribution along the greedy path (0: its first choice; MISS: outside the draft vocabulary)."""
    out = []
    with torch.no_grad():
        for batch in batches(seqs, 4096, torch.Generator().manual_seed(0)):
            bt = pad_batch(batch, teacher.w.shape[1])
            x, m = bt["x"], bt["mask"]
            t = x.shape[1]
            nxt = torch.zeros_like(x)  # the token after each position: the target's greedy choice
            for i, s in enumerate(batch):
                n = len(s["tokens"]) - 1
                nxt[i, :n] = s["tokens"][1 : n + 1]
            want = teacher.remap[nxt]  # its index in the draft vocabulary, -1 outside
            emb, feats, past, ranks = teacher.emb[x], head.fused(bt["prev"]), [], []
            for _ in range(depth):
                g, kv = head.train_pass(emb, feats, rope, past)
                past.append(kv)
                lg = teacher.logits(g)  # [B, T, V_d]
                own = lg.gather(-1, want.clamp(min=0)[..., None])
                r = (lg > own).sum(-1)
                ranks.append(torch.where(want >= 0, r, torch.full_like(r, MISS)))
                feats = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
            if t < depth:
                continue
            starts = t - depth + 1
            # path[b, s, j] = the rank at depth j + 1 for start s: pass j + 1 at position s + j
            path = torch.stack([ranks[j][:, j : j + starts] for j in range(depth)], dim=-1)
            valid = m.unfold(1, depth, 1).all(-1)  # [B, starts]: every position of the path answers
            out.append(path[valid])
    return torch.cat(out) if out else torch.zeros(0, depth, dtype=torch.long)


def best_tree(paths: torch.Tensor, nodes: int, max_rank: int) -> list[tuple[int, ...]]:
    """The ``nodes`` most frequent rank-tuple prefixes of ``paths`` (children ranked below ``max_rank``);
    shorter prefixes first among equals, so the set is prefix-closed."""
    counts: Counter[tuple[int, ...]] = Counter()
    for row in paths.tolist():
        for d in range(1, len(row) + 1):
            if row[d - 1] >= max_rank:
                break
            counts[tuple(row[:d])] += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    tree: set[tuple[int, ...]] = set()
    for node, _ in ranked:
        if len(tree) == nodes:
            break
        if len(node) == 1 or node[:-1] in tree:
            tree.add(node)
    return sorted(tree, key=lambda n: (len(n), n))


def accepted_length(paths: torch.Tensor, tree: list[tuple[int, ...]]) -> float:
    """Mean tokens per target pass (accepted drafts + the target's own token) with ``tree``."""
    nodes = set(tree)
    total = 0
    for row in paths.tolist():
        d = 0
        while d < len(row) and tuple(row[: d + 1]) in nodes:
            d += 1
        total += 1 + d
    return total / max(1, len(paths))


def chain(k: int) -> list[tuple[int, ...]]:
    return [(0,) * d for d in range(1, k + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", type=Path, default=None, help="the EAGLE head folder (default: the one shipped for it)")
    ap.add_argument("--choose-data", type=Path, required=True, help="answers the trees are chosen on")
    ap.add_argument("--choose-shards", default="broad_00[0-3].pt", help="which of --choose-data's shards")
    ap.add_argument("--eval-data", type=Path, required=True, help="eval_NNN.pt: answers the trees are measured on")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--nodes", default="1,2,3,4,6,8,12,16,24,32")
    ap.add_argument("--max-rank", type=int, default=8, help="children considered per node")
    ap.add_argument("--crop-prompt", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--layer-feats", type=Path, default=None, help="feature layers' shards, for an EAGLE-3 head")
    args = ap.parse_args()
    target = load_model(resolve_model(args.model), dtype="float32")
    cfg = target.config
    folder = args.head or HEADS_DIR / f"{args.model}-eagle"
    saved = load_file(str(folder / "head.safetensors"))
    draft_ids = saved.pop("draft_ids").long()
    layers = HeadConfig.read(folder).feature_layers
    if layers and args.layer_feats is None:
        raise SystemExit(f"{folder} fuses layers {layers}: pass --layer-feats (scripts/layer_feats.py shards)")
    head = EagleHead(head_model_config(cfg), layers)
    head.load_state_dict({k: v.float() for k, v in saved.items()})
    head.eval()
    teacher = Teacher(target.model, draft_ids)
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, 4096)

    def greedy(seqs: list[dict]) -> list[dict]:
        return crop([s for s in seqs if s["temperature"] == 0.0], args.crop_prompt)

    aux = args.layer_feats if layers else None
    choose = rank_paths(head, teacher, rope, greedy(load_data(args.choose_data, args.choose_shards, aux)), args.depth)
    measure = rank_paths(head, teacher, rope, greedy(load_data(args.eval_data, "eval_*.pt", aux)), args.depth)
    print(f"head {folder}: {len(choose)} start positions to choose trees on, {len(measure)} to measure on")
    rows = []
    for k in range(1, args.depth + 1):
        rows.append(
            {"tree": f"chain {k}", "nodes": k, "depth": k, "accepted_length": accepted_length(measure, chain(k))}
        )
    for n in [int(v) for v in args.nodes.split(",")]:
        tree = best_tree(choose, n, args.max_rank)
        rows.append(
            {
                "tree": f"best {n}",
                "nodes": len(tree),
                "depth": max(len(t) for t in tree),
                "accepted_length": accepted_length(measure, tree),
                "accepted_length_on_choice_set": accepted_length(choose, tree),
                "nodes_list": [list(t) for t in tree],
            }
        )
    print(f"{'tree':<10} {'nodes':>5} {'depth':>5} {'accepted length (eval prompts)':>31}")
    for r in rows:
        print(f"{r['tree']:<10} {r['nodes']:>5} {r['depth']:>5} {r['accepted_length']:>31.3f}")
    top1 = [float((measure[:, j] == 0).float().mean()) for j in range(args.depth)]
    print("top-1 per depth along the greedy path (eval prompts):", [round(a, 3) for a in top1])
    if args.json:
        args.json.write_text(json.dumps({"head": str(folder), "starts": len(measure), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
