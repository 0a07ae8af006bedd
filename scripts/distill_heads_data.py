"""Self-distillation data for the draft heads: the target's own answers to the training
prompts (``scripts/head_prompts.py``), with the target's final hidden states at every
position, made in one pass (as EAGLE-3 and Medusa-2 recommend: the heads learn the
distribution they will be verified against).

Each prompt is rendered with the model's chat template (``--raw``: fed as plain text, for
the embedded code model, which has none) and answered by the target itself through our own
model runner and paged KV cache, batched, up to ``--max-new`` tokens: greedily for a
``1 - --sampled`` share of the prompts and at temperature 0.7 for the rest (seeded). The
hidden state of every position the target computed (the LM head's input) is kept in
float16.

``--teacher-forced``: instead, written answers that install here (``head_prompts.text_answers``:
standard-library source, module docstrings, package descriptions) are appended to their chat
prompts and the target reads them in prefill passes only (an order of magnitude faster than
generating): the features are the target's on text it did not write (EAGLE-1's recipe); the
heads still learn the target's own next-token distribution, recomputed from those features.
Shards ``<out>/text_NNN.pt``, same format.

Output: shards ``<out>/shard_NNN.pt``, each ``{"tokens": int32 [sum L], "feats": float16
[sum (L - 1), hidden], "lengths": [L...], "prompt_lengths": [P...], "kinds": [...]}`` (a
sequence of L tokens has L - 1 features: the last token is never fed). Shards are written as
batches finish, so an interrupted run keeps what it made; a rerun skips shards that exist.

    python scripts/distill_heads_data.py --model smollm2-135m-instruct --out .cache/heads/smollm2/data
    python scripts/distill_heads_data.py --model default --raw --out .cache/heads/default/data
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_prompts import EVAL_PROMPTS, broad_prompts, text_answers, training_prompts  # noqa: E402
from head_prompts_wide import wide_prompts  # noqa: E402

from draftwise.worker.core.block_manager import BlockManager  # noqa: E402
from draftwise.worker.engine.intake import Intake  # noqa: E402
from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402
from draftwise.worker.text.chat import ChatPrompt  # noqa: E402
from draftwise.worker.text.tokenizer import load_tokenizer  # noqa: E402

PREFILL_TOKENS = 2048  # tokens per prefill forward pass


def encode(
    prompts: list[tuple[str, str]], folder: Path, eos: tuple[int, ...], raw: bool, max_prompt: int
) -> tuple[list[list[int]], tuple[int, ...]]:
    tok = load_tokenizer(folder)
    intake = Intake(tok, folder, eos, 8192, 1 << 30, 0)
    stops = set(intake.eos_token_ids)
    out = []
    for _, p in prompts:
        if raw:
            ids = tok.encode(p)
        else:
            r = intake.encode_chat(ChatPrompt.from_messages([{"role": "user", "content": p}]))
            ids = r.token_ids
            stops.update(r.stop_token_ids)
        out.append(ids[-max_prompt:])
    return out, tuple(sorted(stops))


def generate(
    runner: ModelRunner,
    blocks: BlockManager,
    prompts: list[list[int]],
    temps: list[float],
    stops: tuple[int, ...],
    max_new: int,
    gen: torch.Generator,
) -> list[tuple[list[int], torch.Tensor]]:
    """Answer ``prompts`` together; per prompt (tokens, features [L - 1, hidden] float16)."""
    n = len(prompts)
    tables = [[] for _ in range(n)]
    toks = [list(p) for p in prompts]
    feats: list[list[torch.Tensor]] = [[] for _ in range(n)]
    # prefill, packed into passes of at most PREFILL_TOKENS tokens (a prompt is never split)
    last_logits: list[torch.Tensor | None] = [None] * n
    order = list(range(n))
    while order:
        group, used = [], 0
        while order and (not group or used + len(prompts[order[0]]) <= PREFILL_TOKENS):
            i = order.pop(0)
            group.append(i)
            used += len(prompts[i])
        chunks = []
        for i in group:
            if not blocks.grow(tables[i], len(prompts[i]) + max_new):
                raise RuntimeError("KV pool too small")
            chunks.append(SequenceChunk(prompts[i], 0, tables[i], 1))
        logits, hidden = runner.run_hidden(chunks)
        at = 0
        for row, i in enumerate(group):
            feats[i].append(hidden[at : at + len(prompts[i])].to(torch.float16))
            at += len(prompts[i])
            last_logits[i] = logits[row]
    active = list(range(n))
    stop_set = set(stops)
    while active:
        nxt = []
        for i in active:
            lg = last_logits[i]
            assert lg is not None
            if temps[i] == 0:
                t = int(lg.argmax())
            else:
                t = int(torch.multinomial(torch.softmax(lg / temps[i], -1), 1, generator=gen))
            toks[i].append(t)
            if t not in stop_set and len(toks[i]) - len(prompts[i]) < max_new:
                nxt.append(i)
        active = nxt
        if not active:
            break
        chunks = [SequenceChunk([toks[i][-1]], len(toks[i]) - 1, tables[i], 1) for i in active]
        logits, hidden = runner.run_hidden(chunks)
        for row, i in enumerate(active):
            feats[i].append(hidden[row : row + 1].to(torch.float16))
            last_logits[i] = logits[row]
    for t in tables:
        blocks.free(t)
    return [(toks[i], torch.cat(feats[i])[: len(toks[i]) - 1]) for i in range(n)]


def teacher_forced(runner: ModelRunner, blocks: BlockManager, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The target's features [L - 1, hidden] float16 for each whole sequence, read in prefill
    passes of at most ``PREFILL_TOKENS`` tokens (a sequence is never split)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    order = list(range(len(seqs)))
    while order:
        group, used = [], 0
        while order and (not group or used + len(seqs[order[0]]) <= PREFILL_TOKENS):
            group.append(order.pop(0))
            used += len(seqs[group[-1]])
        tables: list[list[int]] = [[] for _ in group]
        for t, i in zip(tables, group, strict=True):
            if not blocks.grow(t, len(seqs[i])):
                raise RuntimeError("KV pool too small")
        _, hidden = runner.run_hidden([SequenceChunk(seqs[i], 0, t, 1) for t, i in zip(tables, group, strict=True)])
        at = 0
        for i in group:
            out[i] = hidden[at : at + len(seqs[i]) - 1].to(torch.float16)
            at += len(seqs[i])
        for t in tables:
            blocks.free(t)
    return out


def main_teacher_forced(
    args: argparse.Namespace, folder: Path, loaded, runner: ModelRunner, blocks: BlockManager
) -> None:
    triples = text_answers(args.seed)[: args.count]
    tok = load_tokenizer(folder)
    intake = Intake(tok, folder, loaded.config.eos_token_ids, 8192, 1 << 30, 0)
    seqs, prompt_lengths = [], []
    for _, prompt, answer in triples:
        r = intake.encode_chat(ChatPrompt.from_messages([{"role": "user", "content": prompt}]))
        p = r.token_ids[-args.max_prompt :]
        end = list(r.stop_token_ids[:1] or loaded.config.eos_token_ids[:1])
        seqs.append(p + tok.encode(answer)[: args.max_new] + end)
        prompt_lengths.append(len(p))
    t0, made = time.perf_counter(), 0
    for shard, lo in enumerate(range(0, len(seqs), args.batch)):
        path = args.out / f"text_{shard:03d}.pt"
        hi = min(lo + args.batch, len(seqs))
        if path.exists():
            continue
        feats = teacher_forced(runner, blocks, seqs[lo:hi])
        made += sum(len(seqs[i]) - prompt_lengths[i] for i in range(lo, hi))
        torch.save(
            {
                "tokens": torch.tensor([t for s in seqs[lo:hi] for t in s], dtype=torch.int32),
                "feats": torch.cat(feats),
                "lengths": [len(s) for s in seqs[lo:hi]],
                "prompt_lengths": prompt_lengths[lo:hi],
                "kinds": [k for k, _, _ in triples[lo:hi]],
                "temperatures": [0.0] * (hi - lo),
            },
            path,
        )
        el = time.perf_counter() - t0
        print(f"text shard {shard}: {hi}/{len(seqs)} answers, {made} answer tokens, {made / el:.1f} tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model folder, .gguf file, alias, or 'default'")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=1200, help="training prompts")
    ap.add_argument(
        "--prompts",
        choices=("train", "broad", "wide", "eval"),
        default="train",
        help="train: training_prompts (shards shard_NNN.pt); broad: broad_prompts (broad_NNN.pt); wide: head_prompts_wide.wide_prompts (wide_NNN.pt); eval: the "
        "held-out evaluation prompts, greedy (eval_NNN.pt; for figures only, never for training: keep them in "
        "another folder)",
    )
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--max-prompt", type=int, default=384, help="longest prompt kept (its last tokens)")
    ap.add_argument("--batch", type=int, default=48, help="prompts answered together")
    ap.add_argument("--sampled", type=float, default=0.4, help="share of prompts answered at temperature 0.7")
    ap.add_argument("--raw", action="store_true", help="feed prompts as plain text (no chat template)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--teacher-forced", action="store_true", help="read written answers in prefill passes instead of generating"
    )
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    folder = resolve_model(args.model)
    if args.prompts == "eval":
        pairs, args.sampled = list(EVAL_PROMPTS), 0.0
    else:
        make = {"broad": broad_prompts, "wide": wide_prompts, "train": training_prompts}[args.prompts]
        pairs = make(args.count, args.seed)
    prefix = {"train": "shard", "broad": "broad", "wide": "wide", "eval": "eval"}[args.prompts]
    loaded = load_model(folder, dtype="float32")
    bs = 16
    per_seq = -(-(args.max_prompt + args.max_new + 1) // bs)
    blocks = BlockManager(per_seq * args.batch + 1, bs)
    runner = ModelRunner(loaded, KVCache(loaded.config, per_seq * args.batch + 1, bs, loaded.dtype, loaded.device))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.teacher_forced:
        main_teacher_forced(args, folder, loaded, runner, blocks)
        return
    ids, stops = encode(pairs, folder, loaded.config.eos_token_ids, args.raw, args.max_prompt)
    gen = torch.Generator().manual_seed(args.seed)
    temps = [0.7 if (i * 0.618) % 1 < args.sampled else 0.0 for i in range(len(ids))]
    t0, made = time.perf_counter(), 0
    for shard, lo in enumerate(range(0, len(ids), args.batch)):
        path = args.out / f"{prefix}_{shard:03d}.pt"
        if path.exists():
            continue
        hi = min(lo + args.batch, len(ids))
        res = generate(runner, blocks, ids[lo:hi], temps[lo:hi], stops, args.max_new, gen)
        lengths = [len(t) for t, _ in res]
        made += sum(lengths[j] - len(ids[lo + j]) for j in range(hi - lo))
        torch.save(
            {
                "tokens": torch.tensor([t for ts, _ in res for t in ts], dtype=torch.int32),
                "feats": torch.cat([f for _, f in res]),
                "lengths": lengths,
                "prompt_lengths": [len(p) for p in ids[lo:hi]],
                "kinds": [k for k, _ in pairs[lo:hi]],
                "temperatures": temps[lo:hi],
            },
            path,
        )
        el = time.perf_counter() - t0
        print(f"{prefix} {shard}: {hi}/{len(ids)} prompts, {made} new tokens, {made / el:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
