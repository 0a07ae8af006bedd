"""Train an EAGLE head or Medusa heads for a target, on CPU, from self-distillation data
(``scripts/distill_heads_data.py``), and write them, float16, with their config and model card.

Recipe (the head's model card records the figures of the run that made it):

- **draft vocabulary**: the ``--draft-vocab`` most frequent tokens of the data's answers
  (FR-Spec / EAGLE-3): the head only ever proposes those;
- **teacher**: the target's own distribution at every answer position, recomputed from the
  stored final hidden states with the target's LM head, restricted to the draft vocabulary;
- **EAGLE**: one decoder layer (initialised from the target's last), fc over
  ``[embed(x_t); f_{t-1}]``; loss = cross-entropy against the teacher + ``--reg`` x smooth-L1
  of ``g_t`` against ``f_t``, over ``--unroll`` passes: pass 1 reads the target's features,
  pass ``j`` the head's own outputs of pass ``j - 1`` (what drafting position ``j`` sees:
  "training-time test", EAGLE-3), weighted ``0.8^(j-1)``;
- **Medusa**: ``--num-heads`` residual blocks (zero-initialised: each starts as the LM
  head); head ``i`` learns the teacher at ``t + i`` from ``f_t``, weighted ``0.8^(i-1)``.
- ``--init HEAD``: go on from a trained head (its weights and draft vocabulary); ``--crop-prompt N``: keep
  only the last N prompt tokens as context (much less compute where prompts are long);
- AdamW, cosine schedule, a wall-clock budget (``--minutes``); the last 5% of sequences are
  held out for the figures (top-1 agreement with the target per drafting position, and the
  chain acceptance length they imply at temperature 0).

    python scripts/train_heads.py --kind eagle --model smollm2-135m-instruct --data .cache/heads/smollm2/data \\
        --out draftwise/worker/default_models/heads/smollm2-135m-instruct-eagle --minutes 55
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_card import write_card  # noqa: E402

from draftwise.worker.model.loader import load_model
from draftwise.worker.model.rope import RotaryEmbedding
from draftwise.worker.paths import resolve_model
from draftwise.worker.speculative.heads import EagleHead, MedusaHeads, head_model_config, save_head


def load_data(folder: Path, shards: str = "*_[0-9][0-9][0-9].pt", layers: Path | None = None) -> list[dict]:
    """Sequences: tokens [L] int64, feats [L - 1, H] float16, prompt length, temperature; from
    the generated shards (``shard_NNN.pt``) and then the teacher-forced ones (``text_NNN.pt``).
    ``layers``: a folder of ``scripts/layer_feats.py`` shards of the same names; each sequence
    then has ``aux`` [L - 1, n, H] float16 too, the feature layers' streams."""
    seqs = []
    for path in sorted(folder.glob(shards)):
        d = torch.load(path)
        aux = None if layers is None else torch.load(layers / path.name)["feats"]
        at_t = at_f = 0
        for n, p, temp in zip(d["lengths"], d["prompt_lengths"], d["temperatures"], strict=True):
            seqs.append(
                {
                    "source": "text" if path.name.startswith("text_") else "generated",
                    "broad": path.name.startswith("broad_"),
                    "wide": path.name.startswith("wide_"),
                    "file": path.name,
                    "tokens": d["tokens"][at_t : at_t + n].long(),
                    "feats": d["feats"][at_f : at_f + n - 1],
                    **({} if aux is None else {"aux": aux[at_f : at_f + n - 1]}),
                    "prompt": p,
                    "temperature": temp,
                }
            )
            at_t += n
            at_f += n - 1
    return seqs


HELD_OUT = "shard_000.pt"  # the first shard of generated answers: never trained on


def training_data(folder: Path, layers: Path | None = None) -> list[dict]:
    """Every sequence of ``folder``'s shards but the held-out shard's (``HELD_OUT``) and evaluation answers'."""
    return [s for s in load_data(folder, layers=layers) if s["file"] != HELD_OUT and not s["file"].startswith("eval_")]


def crop(seqs: list[dict], keep: int | None) -> list[dict]:
    """Each sequence with only the last ``keep`` prompt tokens (None: whole): less attention
    context, much less compute where prompts are long."""
    if keep is None:
        return seqs
    out = []
    for s in seqs:
        cut = max(0, s["prompt"] - keep)
        out.append({**s, "tokens": s["tokens"][cut:], "feats": s["feats"][cut:], "prompt": s["prompt"] - cut})
        if "aux" in s:
            out[-1]["aux"] = s["aux"][cut:]
    return out


def answer_counts(seqs: list[dict], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["tokens"][s["prompt"] :], minlength=vocab)
    return counts


def draft_vocabulary(seqs: list[dict], size: int, vocab: int) -> tuple[torch.Tensor, float]:
    counts = answer_counts(seqs, vocab)
    top = counts.topk(min(size, vocab)).indices.sort().values
    return top, float(counts[top].sum() / counts.sum())


class Teacher:
    """The target's pieces the heads share: embedding rows, LM-head rows of the draft vocabulary."""

    def __init__(self, model, draft_ids: torch.Tensor) -> None:
        self.emb = model._embedding_dense().detach().clone()  # noqa: SLF001
        head = self.emb if model.lm_head is None else model.lm_head.dense_weight().detach()
        self.full = head  # [V, H]
        self.w = head[draft_ids].contiguous()  # [V_d, H]
        self.remap = torch.full((self.emb.shape[0],), -1, dtype=torch.long)
        self.remap[draft_ids] = torch.arange(draft_ids.numel())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.w)


def batches(seqs: list[dict], tokens_per_batch: int, rng: torch.Generator) -> list[list[dict]]:
    """Length-bucketed batches of about ``tokens_per_batch`` padded tokens, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["tokens"]))
    out, cur = [], []
    for i in order:
        n = len(seqs[i]["tokens"])
        if cur and n * (len(cur) + 1) > tokens_per_batch:
            out.append(cur)
            cur = []
        cur.append(seqs[i])
    if cur:
        out.append(cur)
    perm = torch.randperm(len(out), generator=rng).tolist()
    return [out[i] for i in perm]


def pad_batch(batch: list[dict], hidden: int) -> dict[str, torch.Tensor]:
    """Positions t = 0..T-1 (T = longest L - 1): input token x_t, target feature f_t, the
    previous feature f_{t-1} (0 at t = 0) and whether t is an answer position (predicts
    x_{t+1} with t + 1 >= P). With feature layers (``aux``), ``prev`` holds the target's whole
    row at t - 1: f, then each layer's stream."""
    t_max = max(len(s["tokens"]) - 1 for s in batch)
    b = len(batch)
    n_aux = batch[0]["aux"].shape[1] if "aux" in batch[0] else 0
    x = torch.zeros(b, t_max, dtype=torch.long)
    f = torch.zeros(b, t_max, hidden)
    rows = torch.zeros(b, t_max, (1 + n_aux) * hidden)
    mask = torch.zeros(b, t_max, dtype=torch.bool)
    for i, s in enumerate(batch):
        n = len(s["tokens"]) - 1
        x[i, :n] = s["tokens"][:n]
        f[i, :n] = s["feats"][:n].float()
        rows[i, :n, :hidden] = f[i, :n]
        if n_aux:
            rows[i, :n, hidden:] = s["aux"][:n].float().reshape(n, n_aux * hidden)
        mask[i, max(0, s["prompt"] - 1) : n] = True
    prev = torch.cat([torch.zeros(b, 1, rows.shape[-1]), rows[:, :-1]], dim=1)
    return {"x": x, "f": f, "prev": prev, "mask": mask}


def soft_ce(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return -(F.softmax(teacher_logits, -1) * F.log_softmax(logits, -1)).sum(-1)


def eagle_loss(
    head: EagleHead,
    teacher: Teacher,
    rope: RotaryEmbedding,
    bt: dict[str, torch.Tensor],
    unroll: int,
    reg: float,
    whole_vocab: bool = False,
) -> tuple[torch.Tensor, list[float]]:
    """The loss and top-1 agreement per drafted position: with the target's choice within the
    draft vocabulary, or (``whole_vocab``, for the figures) over its whole vocabulary, where a
    token outside the draft vocabulary is a miss (what acceptance at temperature 0 sees)."""
    emb = teacher.emb[bt["x"]]
    m = bt["mask"]
    t_logits = teacher.logits(bt["f"][m])
    t_top = teacher.remap[F.linear(bt["f"][m], teacher.full).argmax(-1)] if whole_vocab else t_logits.argmax(-1)
    feats, total, accs, past = head.fused(bt["prev"]), 0.0, [], []
    for j in range(unroll):
        g, kv = head.train_pass(emb, feats, rope, past)
        past.append(kv)
        lg = teacher.logits(g[m])
        loss = soft_ce(lg, t_logits).mean() + reg * F.smooth_l1_loss(g[m], bt["f"][m])
        total = total + 0.8**j * loss
        accs.append(float((lg.argmax(-1) == t_top).float().mean()))
        feats = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1).detach()
    return total, accs  # type: ignore[return-value]


def medusa_loss(heads: MedusaHeads, teacher: Teacher, bt: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    f, m = bt["f"], bt["mask"]
    hs = heads(f)  # [B, T, K, H]
    total, accs = 0.0, []
    for i in range(1, heads.num_heads + 1):
        src, tgt = hs[:, :-i, i - 1], f[:, i:]
        mm = m[:, i:] & m[:, :-i]
        t_logits = teacher.logits(tgt[mm])
        lg = teacher.logits(src[mm])
        total = total + 0.8 ** (i - 1) * soft_ce(lg, t_logits).mean()
        accs.append(float((lg.argmax(-1) == t_logits.argmax(-1)).float().mean()))
    return total, accs  # type: ignore[return-value]


def chain_length(accs: list[float]) -> float:
    """Expected tokens per target pass at temperature 0 for a chain of len(accs) drafts, if
    position j is right with probability accs[j] given the earlier ones were."""
    out, p = 1.0, 1.0
    for a in accs:
        p *= a
        out += p
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("eagle", "medusa"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", default=None, help="the target's name in the head's config (default: --model)")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=55.0)
    ap.add_argument("--max-epochs", type=int, default=50)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument(
        "--unroll-after", type=float, default=0.0, help="EAGLE: one pass until this share of the run, then --unroll"
    )
    ap.add_argument("--reg", type=float, default=0.2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument(
        "--feature-layers",
        default="",
        help="EAGLE-3: target layers (0-based, comma-separated) whose output streams the head fuses with the final "
        "state; their features come from --layer-feats",
    )
    ap.add_argument(
        "--layer-feats", type=Path, default=None, help="a folder of scripts/layer_feats.py shards (data and eval)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--init", type=Path, default=None, help="start from this head folder's weights (same kind and target)"
    )
    ap.add_argument(
        "--new-vocab",
        action="store_true",
        help="EAGLE with --init: choose the draft vocabulary (--draft-vocab) from this run's data instead of keeping "
        "the head's",
    )
    ap.add_argument(
        "--crop-prompt", type=int, default=None, help="keep only the last N prompt tokens of each sequence as context"
    )
    ap.add_argument(
        "--eval-data",
        type=Path,
        default=None,
        help="a folder of eval_NNN.pt shards (distill_heads_data.py --prompts eval): the target's answers to the "
        "held-out evaluation prompts, never trained on; the card reports the head's agreement on them",
    )
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = torch.Generator().manual_seed(args.seed)
    target = load_model(resolve_model(args.model), dtype="float32")
    cfg = target.config
    # training data is read again at every epoch (a distillation run still writing shards feeds it)
    feature_layers = [int(i) for i in args.feature_layers.split(",") if i]
    layers = args.layer_feats if feature_layers else None
    first = next(layers.glob("*.pt"), None) if layers is not None else None
    if feature_layers and (first is None or torch.load(first)["layers"] != feature_layers):
        raise SystemExit(f"--feature-layers {feature_layers} needs --layer-feats shards of exactly those layers")
    val = crop(load_data(args.data, HELD_OUT, layers), args.crop_prompt)
    train = crop(training_data(args.data, layers), args.crop_prompt)
    generated = [s for s in train if s["source"] == "generated"]  # the vocabulary of the target's own answers
    draft_ids, coverage = draft_vocabulary(generated or train, args.draft_vocab, cfg.vocab_size)
    teacher = Teacher(target.model, draft_ids)
    module: EagleHead | MedusaHeads
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, 4096)
    if args.kind == "eagle":
        module = EagleHead(head_model_config(cfg), feature_layers)
        module.init_fuse()
        last = target.model.layers[-1]  # the layer starts as the target's last one
        for name, sub in module.layer.named_modules():
            src = last.get_submodule(name) if name else last
            if isinstance(sub, torch.nn.Linear):
                sub.weight.data.copy_(src.dense_weight())  # type: ignore[operator]
                if sub.bias is not None:
                    sub.bias.data.copy_(src.bias)  # type: ignore[arg-type]
            elif hasattr(sub, "eps") and hasattr(sub, "weight"):
                sub.weight.data.copy_(src.weight)  # type: ignore[arg-type]
        module.norm.weight.data.copy_(target.model.norm.weight.detach())
        torch.nn.init.normal_(module.fc.weight, std=0.02)
    else:
        module = MedusaHeads(cfg.hidden_size, args.num_heads)
    if args.init is not None:  # warm start: the head's float16 weights and its draft vocabulary
        from safetensors.torch import load_file

        saved = load_file(str(args.init / "head.safetensors"))
        init_ids = saved.pop("draft_ids").long()
        if not args.new_vocab or args.kind != "eagle":  # (an EAGLE head's weights do not depend on its vocabulary)
            draft_ids = init_ids
            teacher = Teacher(target.model, draft_ids)
            args.draft_vocab = int(draft_ids.numel())  # the card records the vocabulary in use and its coverage
            counts = answer_counts(generated or train, cfg.vocab_size)
            coverage = float(counts[draft_ids].sum() / counts.sum())
        missing, unexpected = module.load_state_dict({k: v.float() for k, v in saved.items()}, strict=False)
        if unexpected or set(missing) - {"fuse.weight"}:  # (a head without feature layers may seed one with them)
            raise SystemExit(f"--init {args.init}: not this {args.kind} head's shape ({missing}, {unexpected})")
    for p in module.parameters():
        p.requires_grad_(True)
    module.train()
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    val_batches = [pad_batch(b, cfg.hidden_size) for b in batches(val, args.tokens_per_batch, rng)]
    eval_seqs = crop(load_data(args.eval_data, "eval_*.pt", layers), args.crop_prompt) if args.eval_data else []
    eval_batches = [pad_batch(b, cfg.hidden_size) for b in batches(eval_seqs, args.tokens_per_batch, rng)]

    def evaluate(on: list[dict[str, torch.Tensor]] | None = None) -> list[float]:
        module.eval()
        with torch.no_grad():
            per = []
            for bt in val_batches if on is None else on:
                _, a = (
                    eagle_loss(module, teacher, rope, bt, max(3, args.unroll), args.reg, whole_vocab=True)
                    if isinstance(module, EagleHead)
                    else medusa_loss(module, teacher, bt)
                )
                per.append(a)
        module.train()
        return [sum(col) / len(col) for col in zip(*per, strict=True)]

    budget = args.minutes * 60
    t0 = time.perf_counter()
    steps_done, epoch, history = 0, 0, []
    while epoch < args.max_epochs and time.perf_counter() - t0 < budget:
        if epoch:
            train = crop(training_data(args.data, layers), args.crop_prompt)
        epoch_batches = batches(train, args.tokens_per_batch, rng)
        for b in epoch_batches:
            el = time.perf_counter() - t0
            if el > budget:
                break
            frac = min(1.0, el / budget)
            for g in opt.param_groups:
                g["lr"] = (
                    args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))) * min(1.0, (steps_done + 1) / 20)
                )
            bt = pad_batch(b, cfg.hidden_size)
            if isinstance(module, EagleHead):
                unroll = 1 if frac < args.unroll_after else args.unroll
                loss, accs = eagle_loss(module, teacher, rope, bt, unroll, args.reg)
            else:
                loss, accs = medusa_loss(module, teacher, bt)
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
            steps_done += 1
            if steps_done % 20 == 0:
                print(
                    f"step {steps_done} epoch {epoch} {el / 60:.1f} min loss {float(loss):.3f} acc {[round(a, 3) for a in accs]}",
                    flush=True,
                )
        epoch += 1
        val_accs = evaluate()
        history.append(
            {
                "epoch": epoch,
                "minutes": round((time.perf_counter() - t0) / 60, 1),
                "val_top1": [round(a, 4) for a in val_accs],
            }
        )
        if eval_batches:
            history[-1]["eval_top1"] = [round(a, 4) for a in evaluate(eval_batches)]
        print(
            f"epoch {epoch}: held-out top-1 {history[-1]['val_top1']} chain length {chain_length(val_accs):.2f}"
            + (f" evaluation prompts {history[-1]['eval_top1']}" if eval_batches else ""),
            flush=True,
        )
    val_accs = evaluate()
    eval_accs = evaluate(eval_batches) if eval_batches else []
    n_train_tokens = sum(len(s["tokens"]) - s["prompt"] for s in train)
    n_text = [s for s in train if s["source"] == "text"]
    training = {
        "data": {
            "sequences": len(train),
            "answer_tokens": n_train_tokens,
            "teacher_forced_sequences": len(n_text),
            "teacher_forced_answer_tokens": sum(len(s["tokens"]) - s["prompt"] for s in n_text),
            "broad_sequences": sum(s["broad"] for s in train),
            "broad_answer_tokens": sum(len(s["tokens"]) - s["prompt"] for s in train if s["broad"]),
            "wide_sequences": sum(s["wide"] for s in train),
            "wide_answer_tokens": sum(len(s["tokens"]) - s["prompt"] for s in train if s["wide"]),
            "held_out_sequences": len(val),
            "source": "scripts/head_prompts.py prompts answered by the target (scripts/distill_heads_data.py)",
        },
        "draft_vocab": {"size": int(draft_ids.numel()), "answer_token_coverage": round(coverage, 4)},
        "recipe": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("data", "out", "model", "name")
        },
        "epochs": epoch,
        "steps": steps_done,
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "held_out_top1_per_position": [round(a, 4) for a in val_accs],
        "held_out_chain_length_t0": round(chain_length(val_accs), 3),
        **({"eval_prompts_answers": len(eval_seqs)} if eval_accs else {}),
        **({"eval_prompts_top1_per_position": [round(a, 4) for a in eval_accs]} if eval_accs else {}),
        **({"eval_prompts_chain_length_t0": round(chain_length(eval_accs), 3)} if eval_accs else {}),
        "history": history,
    }
    module.eval()
    cfg_out = save_head(args.out, module, draft_ids, args.name or args.model, target.model, training)
    write_card(args.out, cfg_out.kind, args.name or args.model, training)
    print(json.dumps(training, indent=1))


if __name__ == "__main__":
    main()
