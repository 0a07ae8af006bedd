"""Where a batch-1 decode step of the embedded default target goes, on this machine: the
profile behind the engine and speculation figures that miss their goals.

1. One request, 256 new tokens, greedy, through the engine (``LLM.generate``) under
   torch's profiler: wall time per step split into the weight matrix products, attention
   (gathering the paged K/V blocks and the attention op itself), the other tensor ops
   (norms, RoPE, activations, KV writes, indexing, views) and what is left: Python and the
   engine's own work between ops (scheduling, sampling bookkeeping, output processing).
2. The weight products alone: every projection of the model, one row at a time, back to
   back as a step runs them (weights streamed from memory, not from cache), against the
   memory's read bandwidth measured in the same run (one and all threads): how close the
   matrix-vector products come to the roofline.
3. The draft model's step against the target's, same way.
4. What speculation pays for at batch 1: the target's forward pass over ``1 + k`` tokens of
   one sequence (a verify step) and the draft's one-token step, each against a plain decode
   step, and the speedup those costs allow at the measured acceptance.

    python bench/bench_profile.py [--model MODEL] [--threads 2]

Writes docs/benchmarks.md (section ``profile``) and bench/results/profile.json. With another
``--model`` (default: the embedded target) the draft model's parts (3, and the draft steps
in 4) are left out, as the embedded draft pairs with the embedded target only; it writes
section ``profile-<model>`` and profile_<model>.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    add_model_argument,
    for_model,
    heldout_prompts,
    is_default_model,
    machine,
    model_label,
    save_results,
    write_section,
)

from draftwise.worker import LLM, SamplingParams, default_model_path  # noqa: E402
from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.llama import Linear  # noqa: E402
from draftwise.worker.model.loader import cpu_products, load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402

NEW_TOKENS = 256
GROUPS = {
    "weight products": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "draftwise::cpu_matmul",
        "quantized::linear_dynamic_fp16",
    ),
    "attention": ("aten::index_select", "aten::_scaled_dot_product_flash_attention_for_cpu"),
}


def profile_engine(llm: LLM, prompt: list[int]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    plain_s = time.perf_counter() - t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        profiled_s = time.perf_counter() - t
    self_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in prof.key_averages():
        self_us[e.key] = e.self_cpu_time_total
        calls[e.key] = e.count
    total_ops = sum(self_us.values())
    groups = {g: sum(self_us.get(k, 0.0) for k in keys) for g, keys in GROUPS.items()}
    groups["other tensor ops"] = total_ops - sum(groups.values())
    # the profiler's own cost inflates the wall time; scale the op times to the unprofiled run
    steps = NEW_TOKENS
    per_step_ms = {g: v / 1000 / steps for g, v in groups.items()}
    per_step_ms["Python and engine work between ops"] = max(0.0, profiled_s * 1000 / steps - total_ops / 1000 / steps)
    top = sorted(self_us.items(), key=lambda kv: -kv[1])[:8]
    return {
        "step_ms_unprofiled": plain_s * 1000 / steps,
        "step_ms_profiled": profiled_s * 1000 / steps,
        "per_step_ms": per_step_ms,
        "ops_per_step": sum(calls.values()) / steps,
        "top_ops": [{"op": k, "ms_per_step": v / 1000 / steps, "calls_per_step": calls[k] / steps} for k, v in top],
    }


def _projections(model: nn.Module) -> list[nn.Module]:
    """Every projection one decode step multiplies by (laid out as the model runs them), in
    the order the step does."""
    mods = [m for m in model.modules() if isinstance(m, Linear)]
    return mods + ([model._lm_head] if model._lm_head is not None else [])


def weight_stream(model: nn.Module, repeats: int = 50) -> dict:
    mods = _projections(model)
    xs = [torch.randn(1, m.in_features) for m in mods]
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in mods)

    def run() -> None:
        for x, m in zip(xs, mods, strict=True):
            m(x)

    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return {"weight_mb": nbytes / 1e6, "ms": best * 1000, "gb_s": nbytes / best / 1e9}


def step_costs(context: int = 128, steps: int = 60, max_k: int = 5, model: str | None = None) -> dict:
    """Median ms of the target's forward pass over ``1 + k`` tokens of one sequence (k = 0: a
    plain decode step) and of the draft's one-token step (embedded target only), at
    ``context`` tokens."""

    def timed(which: str, n_new: int) -> float:
        path = resolve_model(model) if which == "target" else default_model_path(which)
        loaded = load_model(path, dtype="float32")
        blocks = -(-(context + steps * n_new + 8) // 16)
        runner = ModelRunner(loaded, KVCache(loaded.config, blocks, 16, torch.float32, "cpu"))
        table = list(range(blocks))
        runner.run([SequenceChunk([1] + [5 + i % 100 for i in range(context - 1)], 0, table)])
        pos, times = context, []
        for i in range(steps):
            ids = [5 + (i + j) % 100 for j in range(n_new)]
            t = time.perf_counter()
            runner.run([SequenceChunk(ids, pos, table, n_new)])
            times.append(time.perf_counter() - t)
            pos += n_new
        return 1000 * statistics.median(times[steps // 4 :])

    target = {k: timed("target", 1 + k) for k in range(max_k + 1)}
    if not is_default_model(model):
        return {"target_ms": target}
    return {"target_ms": target, "draft_ms": timed("draft", 1)}


def read_bandwidth(threads: int, nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second read by a large sum (each byte read once, nothing written)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(nbytes // 4)
        a.sum()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a.sum()
            best = min(best, time.perf_counter() - t)
        return nbytes / best
    finally:
        torch.set_num_threads(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(ap)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    default = is_default_model(args.model)
    if not default:
        r["model"] = args.model
    target = LLM(model=args.model, dtype="float32")
    prompt = heldout_prompts(target.get_tokenizer(), 1, (64, 64), seed=0)[0]
    r["engine"] = profile_engine(target, prompt)
    r["cpu_products"] = cpu_products(target.engine.loaded.model)
    r["target_weights"] = weight_stream(target.engine.loaded.model)
    del target
    if default:
        r["draft_weights"] = weight_stream(load_model(default_model_path("draft"), dtype="float32").model)
    r["steps"] = step_costs(model=args.model)
    r["read_gb_s_1_thread"] = read_bandwidth(1) / 1e9
    r["read_gb_s_all_threads"] = read_bandwidth(args.threads) / 1e9
    print(json.dumps(r, indent=1))
    save_results(for_model("profile", args.model, "_"), r)
    write_section(for_model("profile", args.model), render(r))


def render(r: dict) -> str:
    e = r["engine"]
    model = r.get("model")
    flag = "" if is_default_model(model) else f" --model {model}"
    lines = [
        f"## Profile of a batch-1 decode step ({model_label(model)}, float32, CPU)",
        "",
        f"Command: `python bench/bench_profile.py{flag}` — {r['date']}, {r['machine']}",
        "",
        f"One request, {NEW_TOKENS} new tokens, greedy, through the engine under torch's profiler: "
        f"{e['step_ms_unprofiled']:.2f} ms per step unprofiled ({e['step_ms_profiled']:.2f} ms profiled), "
        f"{e['ops_per_step']:.0f} tensor ops per step.",
        "",
        "| part of a step | ms per step (profiled) | share |",
        "| --- | --- | --- |",
    ]
    total = sum(e["per_step_ms"].values())
    for name, ms in e["per_step_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | {ms / total:.0%} |")
    lines += [
        "",
        "| op | ms per step | calls per step |",
        "| --- | --- | --- |",
        *(f"| `{o['op']}` | {o['ms_per_step']:.3f} | {o['calls_per_step']:.0f} |" for o in e["top_ops"]),
        "",
        "The weight products alone, one row through every projection back to back (weights streamed",
        "from memory as in a step), against a large read measured in the same run:",
        "",
        "| model | weights read per step | time | GB/s | share of 1-thread read bandwidth | share of all-thread read bandwidth |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("target", "draft"):
        w = r.get(f"{name}_weights")
        if w is None:
            continue
        lines.append(
            f"| {name} | {w['weight_mb']:.1f} MB | {w['ms']:.2f} ms | {w['gb_s']:.1f} | "
            f"{w['gb_s'] / r['read_gb_s_1_thread']:.0%} | {w['gb_s'] / r['read_gb_s_all_threads']:.0%} |"
        )
    if "steps" in r:
        st = r["steps"]
        tm = {int(k): v for k, v in st["target_ms"].items()}  # JSON keys are strings
        plain = tm[0]
        if "draft_ms" not in st:  # another target: no draft model; what a verify step costs, drafts taken as free
            lines += [
                "",
                "What a verify step costs at batch 1 (one sequence at 128 tokens of context; a plain step = 1), "
                "and the per-token acceptance at which a round breaks even if drafting cost nothing:",
                "",
                "| k | verify step: target over 1 + k tokens (ms) | in plain steps | break-even acceptance, free drafts |",
                "| --- | --- | --- | --- |",
            ]
            lines += [
                f"| {k} | {ms:.2f} | {ms / plain:.2f} | {_break_even_acceptance(k, ms / plain):.2f} |"
                for k, ms in sorted(tm.items())
                if k
            ]
            lines += ["", f"Plain decode step {plain:.2f} ms."]
        else:
            lines += _draft_rows(st, tm, plain)
    lines += [
        "",
        f"Read bandwidth: {r['read_gb_s_1_thread']:.1f} GB/s with one thread, {r['read_gb_s_all_threads']:.1f} GB/s "
        "with all. Products: " + r.get("cpu_products", "torch (column blocks)") + ' (docs/models.md, "The CPU kernel"; '
        "`DRAFTWISE_CPU_KERNELS=0` measures torch's).",
    ]
    return "\n".join(lines)


def _draft_rows(st: dict, tm: dict[int, float], plain: float) -> list[str]:
    """The embedded pair's "what speculation pays for" table: verify steps and draft steps."""
    lines = [
        "",
        "What speculation pays for at batch 1 (one sequence at 128 tokens of context; a plain step = 1):",
        "",
        "| k | verify step: target over 1 + k tokens (ms) | in plain steps | round with its k draft steps "
        "(plain steps = tokens it must yield to break even) | per-token acceptance that breaks even |",
        "| --- | --- | --- | --- | --- |",
    ]
    d = st["draft_ms"] / plain
    for k, ms in sorted(tm.items()):
        if k == 0:
            continue
        cost = ms / plain + k * d
        lines.append(f"| {k} | {ms:.2f} | {ms / plain:.2f} | {cost:.2f} | {_break_even_acceptance(k, cost):.2f} |")
    lines += [
        "",
        f"Plain decode step {plain:.2f} ms; draft step {st['draft_ms']:.2f} ms ({d:.2f} of a plain step). A round of "
        "k drafts yields (1 - a^(k+1)) / (1 - a) tokens at per-token acceptance a; speculation gains only "
        "where that exceeds the round's cost in plain steps.",
    ]
    return lines


def _break_even_acceptance(k: int, cost: float) -> float:
    """The per-token acceptance a at which a round of k drafts yields ``cost`` tokens
    ((1 - a^(k+1)) / (1 - a) = cost), by bisection; 1.0 when even a = 1 falls short."""
    if k + 1 <= cost:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**j for j in range(k + 1)) < cost:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


if __name__ == "__main__":
    main()
