"""Train the embedded default models: a byte-level BPE tokenizer, a Llama target and a
Llama draft distilled from it, all on the Python standard library's own source code.

Reproduce (about an hour on 2 CPU cores; see the model cards for the recorded run):

    python scripts/train_default_models.py --out worker/default_models

Data: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-packages
excluded). A file is held out for validation when ``crc32(relative path) % 25 == 0``;
the held-out list is written to ``docs/heldout_files.txt`` for benchmarks.

Training uses Hugging Face transformers' own ``LlamaForCausalLM`` (so the checkpoints
are ordinary HF folders); draftwise's runtime is tested against it separately.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
VOCAB_SIZE = 8192


@dataclass(frozen=True)
class Shape:
    """Architecture of one of the two models."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


TARGET = Shape(
    hidden_size=256, intermediate_size=768, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4
)
DRAFT = Shape(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 25 == 0


def stdlib_files() -> tuple[list[Path], list[Path], Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or path.stat().st_size > 2_000_000:
            continue
        (heldout if is_heldout(rel) else train).append(path)
    return train, heldout, root


def is_test_file(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for f in files:
            t = read_text(f)
            if t:
                yield t

    tok.train_from_iterator(texts(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def encode_stream(tok, files: list[Path]) -> torch.Tensor:
    """All files as one stream: <s> file </s> <s> file </s> ..."""
    texts = [t for t in (read_text(f) for f in files) if t]
    encs = tok.encode_batch(texts)
    ids: list[int] = []
    for e in encs:
        ids.extend(e.ids)  # starts with <s> (post-processor)
        ids.append(2)
    return torch.tensor(ids, dtype=torch.int32)


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    n = stream.numel() - seq - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        x = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()]).long()
        yield x


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def make_model(shape: Shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_act="silu",
    )
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq: int, n_batches: int = 24, batch: int = 8) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    it = batches(stream, batch, seq, gen)
    total = 0.0
    for _ in range(n_batches):
        x = next(it)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).item()
    model.train()
    return total / n_batches


def train(model, stream, val_stream, *, steps, batch, seq, peak_lr, teacher=None, log_every=25, seed=0):
    gen = torch.Generator().manual_seed(seed)
    it = batches(stream, batch, seq, gen)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )
    model.train()
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup=min(100, steps // 10))
        x = next(it)
        inp, tgt = x[:, :-1], x[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=inp).logits.float()
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=inp).logits.float()
                kl = F.kl_div(
                    F.log_softmax(logits, -1).reshape(-1, logits.size(-1)),
                    F.log_softmax(t_logits, -1).reshape(-1, logits.size(-1)),
                    log_target=True,
                    reduction="batchmean",
                )
                loss = 0.3 * ce + 0.7 * kl
            else:
                loss = ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t0
            log(
                f"step {step}/{steps} loss {loss.item():.3f} ce {ce.item():.3f} tok/s {(step + 1) * batch * seq / el:.0f} elapsed {el / 60:.1f} min"
            )
        if step > 0 and step % 500 == 0:
            log(f"  val ce {evaluate(model, val_stream, seq):.3f}")
    return time.time() - t0


@torch.no_grad()
def greedy_acceptance(
    target, draft, tok, heldout: list[Path], n_prompts: int = 24, prompt_len: int = 64, gen_len: int = 128
) -> dict:
    """Per-token greedy acceptance: over the target's own greedy continuations of
    held-out code, how often the draft's argmax equals the target's argmax given the
    same prefix. Also the mean accepted length for k=4 speculation."""
    target.eval()
    draft.eval()
    rng = random.Random(0)
    files = [f for f in heldout if (read_text(f) or "").count("\n") > 40]
    rng.shuffle(files)
    agree = total = 0
    run_lengths: list[int] = []
    for f in files[:n_prompts]:
        ids = tok.encode(read_text(f)).ids
        start = rng.randrange(0, max(1, len(ids) - prompt_len - 1))
        prompt = torch.tensor([[1] + ids[start : start + prompt_len]])
        out = target.generate(prompt, max_new_tokens=gen_len, do_sample=False, pad_token_id=0, eos_token_id=None)
        seq = out[:, :-1]
        t_arg = target(input_ids=seq).logits.argmax(-1)[0, prompt.size(1) - 1 :]
        d_arg = draft(input_ids=seq).logits.argmax(-1)[0, prompt.size(1) - 1 :]
        match = (t_arg == d_arg).tolist()
        agree += sum(match)
        total += len(match)
        # mean accepted tokens per k=4 round, walking the sequence
        i = 0
        while i < len(match):
            acc = 0
            while acc < 4 and i + acc < len(match) and match[i + acc]:
                acc += 1
            run_lengths.append(acc)
            i += acc + 1
    return {
        "greedy_acceptance_rate": agree / total,
        "mean_accepted_per_round_k4": sum(run_lengths) / len(run_lengths),
        "positions": total,
        "prompts": min(n_prompts, len(files)),
    }


@torch.no_grad()
def decode_step_ms(model, ctx: int = 128, steps: int = 64) -> float:
    """Median wall time of one batch-1 decode step with HF's KV cache (float32, eager)."""
    from transformers import DynamicCache

    model = model.float().eval()
    ids = torch.randint(3, VOCAB_SIZE, (1, ctx))
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


def write_tokenizer_config(folder: Path) -> None:
    """A tokenizer_config.json that transformers 4.x and 5.x both read, and that leaves
    decoded text exactly as encoded (no clean-up of spaces before punctuation)."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "special_tokens_map.json").unlink(missing_ok=True)


def save(model, tok, folder: Path) -> None:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    model.float()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf_tok.model_max_length = 2048
    hf_tok.save_pretrained(folder)
    write_tokenizer_config(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="worker/default_models")
    ap.add_argument("--target-steps", type=int, default=1200)
    ap.add_argument("--target2-steps", type=int, default=250)
    ap.add_argument("--draft-steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stage", choices=["all", "target", "target2", "draft", "eval"], default="all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.out)
    work = Path(os.environ.get("DRAFTWISE_TRAIN_WORK", "/tmp/draftwise_train"))
    work.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    train_files, heldout_files, root = stdlib_files()
    log(f"stdlib {root}: {len(train_files)} train files, {len(heldout_files)} held-out files")
    Path("docs").mkdir(exist_ok=True)
    Path("docs/heldout_files.txt").write_text("".join(f.relative_to(root).as_posix() + "\n" for f in heldout_files))

    from tokenizers import Tokenizer

    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        tok = train_tokenizer(train_files)
        tok.save(str(tok_path))
        log(f"tokenizer trained: vocab {tok.get_vocab_size()}")
    tok = Tokenizer.from_file(str(tok_path))
    stream_path = work / "streams.pt"
    if stream_path.exists():
        streams = torch.load(stream_path)
    else:
        streams = {"train": encode_stream(tok, train_files), "val": encode_stream(tok, heldout_files)}
        torch.save(streams, stream_path)
    train_stream, val_stream = streams["train"], streams["val"]
    chars = sum(len(read_text(f) or "") for f in train_files)
    log(
        f"train tokens {train_stream.numel():,} ({chars / train_stream.numel():.2f} chars/token), val tokens {val_stream.numel():,}"
    )

    stats: dict = {
        "python": platform.python_version(),
        "stdlib": str(root),
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_tokens": int(train_stream.numel()),
        "val_tokens": int(val_stream.numel()),
        "batch": args.batch,
        "seq": args.seq,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    stats_path = work / "stats.json"
    if stats_path.exists() and args.stage != "all":
        stats = {**json.loads(stats_path.read_text()), **stats}

    from transformers import LlamaForCausalLM

    if args.stage in ("all", "target"):
        target = make_model(TARGET)
        stats["target_params"] = sum(p.numel() for p in target.parameters())
        log(f"target: {stats['target_params'] / 1e6:.2f}M params")
        secs = train(
            target, train_stream, val_stream, steps=args.target_steps, batch=args.batch, seq=args.seq, peak_lr=2e-3
        )
        stats["target_steps"] = args.target_steps
        stats["target_train_minutes"] = secs / 60
        stats["target_val_loss"] = evaluate(target, val_stream, args.seq)
        log(f"target val ce {stats['target_val_loss']:.3f}")
        save(target, tok, out / "target")
        stats_path.write_text(json.dumps(stats, indent=1))
    if args.stage in ("all", "target", "target2"):
        # stage 2: library code only (the test suite is 60% of the stdlib and pulls the model towards
        # assertEqual lines); a lower learning rate, continuing from stage 1
        target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
        lib_files = [f for f in train_files if not is_test_file(f.relative_to(root).as_posix())]
        lib_stream = encode_stream(tok, lib_files)
        log(f"stage 2: {len(lib_files)} library files, {lib_stream.numel():,} tokens")
        secs = train(
            target,
            lib_stream,
            val_stream,
            steps=args.target2_steps,
            batch=args.batch,
            seq=args.seq,
            peak_lr=1e-3,
            seed=2,
        )
        stats["target2_steps"] = args.target2_steps
        stats["target2_train_minutes"] = secs / 60
        stats["target2_tokens"] = int(lib_stream.numel())
        stats["target_val_loss"] = evaluate(target, val_stream, args.seq)
        log(f"target val ce after stage 2 {stats['target_val_loss']:.3f}")
        save(target, tok, out / "target")
        stats_path.write_text(json.dumps(stats, indent=1))
    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    lib_heldout = [f for f in heldout_files if not is_test_file(f.relative_to(root).as_posix())]
    stats["target_val_loss_library"] = evaluate(target, encode_stream(tok, lib_heldout), args.seq)

    if args.stage in ("all", "draft"):
        draft = make_model(DRAFT)
        # start from the target's embedding, first layer and final norm
        draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        stats["draft_params"] = sum(p.numel() for p in draft.parameters())
        log(f"draft: {stats['draft_params'] / 1e6:.2f}M params, distilling from target")
        target.eval()
        for p in target.parameters():
            p.requires_grad_(False)
        secs = train(
            draft,
            train_stream,
            val_stream,
            steps=args.draft_steps,
            batch=args.batch,
            seq=args.seq,
            peak_lr=2e-3,
            teacher=target,
            seed=1,
        )
        stats["draft_steps"] = args.draft_steps
        stats["draft_train_minutes"] = secs / 60
        stats["draft_val_loss"] = evaluate(draft, val_stream, args.seq)
        stats["draft_val_loss_library"] = evaluate(draft, encode_stream(tok, lib_heldout), args.seq)
        log(f"draft val ce {stats['draft_val_loss']:.3f}")
        save(draft, tok, out / "draft")
        stats_path.write_text(json.dumps(stats, indent=1))
    draft = LlamaForCausalLM.from_pretrained(out / "draft", dtype=torch.float32)

    acc = greedy_acceptance(target, draft, tok, heldout_files)
    stats.update(acc)
    log(f"acceptance {acc}")
    stats["target_decode_step_ms_hf"] = decode_step_ms(target)
    stats["draft_decode_step_ms_hf"] = decode_step_ms(draft)
    stats["total_minutes"] = (time.time() - t_start) / 60
    log(
        f"decode step (HF eager, batch 1): target {stats['target_decode_step_ms_hf']:.2f} ms, draft {stats['draft_decode_step_ms_hf']:.2f} ms"
    )
    stats_path.write_text(json.dumps(stats, indent=1))
    (out / "training_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    log("done")


if __name__ == "__main__":
    main()
