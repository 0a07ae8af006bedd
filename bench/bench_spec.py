"""Speculative decoding benchmarks on the embedded default pair (target 10M, draft 3M),
float32 on CPU; every ratio comes from measurements of the same run:

1. ``greedy``: batch 1, held-out standard-library code as prompts, 256 new tokens, greedy:
   acceptance rate, mean accepted length, speedup over our own plain decoding and over
   transformers' assisted generation with the same pair (and its plain ``generate``).
2. ``ngram``: n-gram prompt lookup on a prompt that asks to repeat a block of code with an
   edit, against our plain decoding.
3. ``concurrency``: output tokens/s with and without speculation (the adaptive policy) at
   concurrency 1, 4, 16 and 64.
4. ``temperature``: batch 1 at temperature 0.7 (seeded): acceptance rate and speedup.

    python bench/bench_spec.py [--model MODEL] [--only greedy,ngram,concurrency,temperature] [--threads 2]
    python bench/bench_spec.py --replot     # tables and plots again from bench/results/spec.json

Results go to docs/benchmarks.md (section ``speculative``) and bench/results/spec.json; the
plots (tokens/s against concurrency, plain and speculative; mean accepted length against a
fixed k, draft model and n-gram lookup) to docs/img/.

``--model`` (default: the embedded target) runs another target: only ``ngram`` then, as the
embedded draft pairs with the embedded target only (bench/bench_heads.py compares every
method on such a model); section ``speculative-<model>``, bench/results/spec_<model>.json
and plots named ``spec_*_<model>.png``.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    ROOT,
    add_model_argument,
    for_model,
    heldout_prompts,
    heldout_texts,
    is_default_model,
    machine,
    model_label,
    model_slug,
    write_section,
)

from draftwise.worker import LLM, SamplingParams, default_model_path  # noqa: E402

NEW_TOKENS = 256
NUM_PROMPTS = 4  # batch-1 runs go through this many held-out prompts one after another
MODEL: str | None = None  # the target of every engine _llm builds (--model; None: the embedded one)
DRAFT_PARTS = ("greedy", "concurrency", "temperature")  # the parts that use the embedded draft model


def _llm(**spec) -> LLM:
    return LLM(dtype="float32", **{"model": MODEL, **spec})


def _spec_stats(outs) -> dict:
    prop = sum(o.outputs[0].num_spec_proposed for o in outs)
    acc = sum(o.outputs[0].num_spec_accepted for o in outs)
    rounds = sum(o.outputs[0].spec.verify_steps for o in outs if o.outputs[0].spec is not None)
    return {
        "proposed": prop,
        "accepted": acc,
        "verify_steps": rounds,
        "acceptance_rate": acc / prop if prop else 0.0,
        "mean_accepted_length": 1 + acc / rounds if rounds else 0.0,
    }


def _interleaved(
    llms: dict[str, LLM], prompts: list[list[int]], params: list[SamplingParams], repeats: int = 2
) -> dict[str, tuple[float, list]]:
    """Batch 1: every prompt through every configuration, alternating configurations, the
    whole round ``repeats`` times; per configuration the sum over prompts of the fastest run
    of each (this shared 2-core machine has bursts of interference that would otherwise
    land on one configuration) and the outputs."""
    for llm in llms.values():  # warm-up
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    best: dict[str, list[float]] = {name: [float("inf")] * len(prompts) for name in llms}
    outs: dict[str, list] = {name: [None] * len(prompts) for name in llms}
    for _ in range(repeats):
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            for name, llm in llms.items():
                t = time.perf_counter()
                out = llm.generate([p], sp, use_tqdm=False)[0]
                best[name][i] = min(best[name][i], time.perf_counter() - t)
                outs[name][i] = out
    return {name: (sum(best[name]), outs[name]) for name in llms}


def _hf_models():
    from transformers import AutoModelForCausalLM

    def load(which):
        return AutoModelForCausalLM.from_pretrained(
            default_model_path(which), dtype=torch.float32, local_files_only=True
        ).eval()

    return load("target"), load("draft")


def _hf_run(target, prompts, assistant=None) -> tuple[float, list[list[int]]]:
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    if assistant is not None:
        gen["assistant_model"] = assistant
    outs = []
    with torch.no_grad():
        target.generate(torch.tensor([prompts[0]]), **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
        t = time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p])
            outs.append(target.generate(ids, **gen)[0, len(p) :].tolist())
        return time.perf_counter() - t, outs


FIXED_K = (1, 2, 3, 4, 5)  # the fixed-k sweep behind the accepted-length plot


def _fixed(k: int, **spec) -> dict:
    return dict(num_speculative_tokens=k, speculative_adaptive=False, **spec)


GREEDY_CONFIGS = {
    "adaptive (default: k <= 5)": dict(speculative_model="default"),
    **{f"fixed k={k}": _fixed(k, speculative_model="default") for k in FIXED_K},
}


def _spec_table(results: dict, n_tokens: int, plain_s: float, ref: list | None) -> dict:
    rows = {}
    for name, (s, outs) in results.items():
        if name == "plain":
            continue
        rows[name] = {
            "seconds": s,
            "tokens_per_s": n_tokens / s,
            "speedup_vs_plain": plain_s / s,
            **_spec_stats(outs),
        }
        if ref is not None:
            rows[name]["same_tokens_as_plain"] = [o.outputs[0].token_ids for o in outs] == ref
        print(name, json.dumps(rows[name]), flush=True)
    return rows


def bench_greedy(prompts: list[list[int]]) -> dict:
    n_tokens = NEW_TOKENS * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    llms = {"plain": _llm(), **{name: _llm(**spec) for name, spec in GREEDY_CONFIGS.items()}}
    res = _interleaved(llms, prompts, params)
    plain_s, plain = res["plain"]
    ref = [o.outputs[0].token_ids for o in plain]
    rows = _spec_table(res, n_tokens, plain_s, ref)
    hf_t, hf_d = _hf_models()
    hf_plain_s, hf_plain = _hf_run(hf_t, prompts)
    hf_assist_s, hf_assist = _hf_run(hf_t, prompts, assistant=hf_d)
    best = rows["adaptive (default: k <= 5)"]
    return {
        "prompts": len(prompts),
        "new_tokens": NEW_TOKENS,
        "plain_s": plain_s,
        "plain_tokens_per_s": n_tokens / plain_s,
        "spec": rows,
        "hf_generate_s": hf_plain_s,
        "hf_generate_tokens_per_s": n_tokens / hf_plain_s,
        "hf_assisted_s": hf_assist_s,
        "hf_assisted_tokens_per_s": n_tokens / hf_assist_s,
        "hf_assisted_same_tokens": hf_assist == ref,
        "hf_generate_same_tokens": hf_plain == ref,
        "speedup_vs_plain": plain_s / best["seconds"],
        "speedup_vs_hf_assisted": hf_assist_s / best["seconds"],
        "speedup_vs_hf_generate": hf_plain_s / best["seconds"],
    }


def _edit_prompt(tokenizer) -> list[int]:
    """A block of held-out code, then a request to write it again with one name changed, and
    the start of the copy."""
    text = next(t for t in heldout_texts() if "def " in t)
    start = text.index("def ")
    block = text[start : start + 1500]
    block = block[: block.rfind("\n")]
    name = block[4 : block.index("(")]
    prompt = (
        f"{block}\n\n\n# The same function again, with `{name}` renamed to `{name}_v2` and nothing else changed:\n\n"
        f"def {name}_v2("
    )
    return tokenizer.encode(prompt)


def bench_ngram(tokenizer) -> dict:
    prompt = _edit_prompt(tokenizer)
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)]
    llms = {
        "plain": _llm(),
        "adaptive (default: k <= 5)": _llm(speculative_method="ngram"),
        **{f"fixed k={k}": _llm(**_fixed(k, speculative_method="ngram")) for k in FIXED_K},
    }
    res = _interleaved(llms, [prompt], params, repeats=3)
    plain_s, plain = res["plain"]
    out = {"prompt_tokens": len(prompt), "plain_s": plain_s, "plain_tokens_per_s": NEW_TOKENS / plain_s}
    out.update(_spec_table(res, NEW_TOKENS, plain_s, [plain[0].outputs[0].token_ids]))
    out["sample"] = tokenizer.decode(plain[0].outputs[0].token_ids[:120])
    return out


def _throughput(llm: LLM, prompts: list[list[int]], concurrency: int, new_tokens: int) -> tuple[float, list]:
    """``len(prompts)`` requests kept ``concurrency`` at a time in the engine; seconds, outputs."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    queue = list(enumerate(prompts))
    outs = {}
    t = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            i, p = queue.pop(0)
            engine.add_request(f"c{concurrency}-{i}", p, params)
        for o in engine.step().finished:
            outs[o.request_id] = o
    return time.perf_counter() - t, list(outs.values())


def bench_concurrency(tokenizer, levels=(1, 4, 16, 64), new_tokens: int = 128) -> list[dict]:
    rows = []
    plain_llm, spec_llm = _llm(), _llm(speculative_model="default")
    for c in levels:
        n = max(2 * c, 4)
        prompts = heldout_prompts(tokenizer, n, (32, 256), seed=100 + c)
        _throughput(plain_llm, prompts[:2], min(c, 2), 8)  # warm-up
        _throughput(spec_llm, prompts[:2], min(c, 2), 8)
        plain_s = spec_s = float("inf")
        for _ in range(2):  # alternate, keep each side's fastest run
            plain_s = min(plain_s, _throughput(plain_llm, prompts, c, new_tokens)[0])
            s, outs = _throughput(spec_llm, prompts, c, new_tokens)
            spec_s = min(spec_s, s)
        row = {
            "concurrency": c,
            "requests": n,
            "new_tokens": new_tokens,
            "plain_tokens_per_s": n * new_tokens / plain_s,
            "spec_tokens_per_s": n * new_tokens / spec_s,
            "ratio": plain_s / spec_s,
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"),
            **_spec_stats(outs),
        }
        rows.append(row)
        print("concurrency", json.dumps(row), flush=True)
    return rows


def bench_temperature(prompts: list[list[int]]) -> dict:
    n_tokens = NEW_TOKENS * len(prompts)
    params = [
        SamplingParams(temperature=0.7, max_tokens=NEW_TOKENS, ignore_eos=True, seed=i) for i in range(len(prompts))
    ]
    llms = {
        "plain": _llm(),
        "adaptive (default: k <= 5)": _llm(speculative_model="default"),
        "fixed k=3": _llm(speculative_model="default", num_speculative_tokens=3, speculative_adaptive=False),
    }
    res = _interleaved(llms, prompts, params)
    plain_s, _ = res["plain"]
    out = {"plain_s": plain_s, "plain_tokens_per_s": n_tokens / plain_s}
    out.update(_spec_table(res, n_tokens, plain_s, None))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(ap)
    ap.add_argument("--only", default="greedy,ngram,concurrency,temperature")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replot", action="store_true", help="run nothing: tables and plots from the saved results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    which = set(args.only.split(","))
    global MODEL
    MODEL = None if is_default_model(args.model) else args.model
    section, img = for_model("speculative", MODEL), ROOT / "docs" / "img"
    out_path = ROOT / "bench" / "results" / f"{for_model('spec', MODEL, '_')}.json"
    results: dict = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.replot:
        write_section(section, render(results))
        print("\n".join(str(p) for p in plot(results, img)))
        return
    if MODEL is not None:
        for name in sorted(which & set(DRAFT_PARTS)):
            print(f"{name}: skipped: no draft model with this tokenizer installs here", flush=True)
        which -= set(DRAFT_PARTS)
        if not which:
            ap.error("with another --model only the ngram part runs: --only ngram")
        results.update({"model": MODEL, "machine": machine(), "date": time.strftime("%Y-%m-%d")})
    if "greedy" in which:  # the header's machine and date are section 1's (section 3 records its own)
        results.update({"machine": machine(), "date": time.strftime("%Y-%m-%d")})
    tokenizer = _llm().get_tokenizer()
    prompts = heldout_prompts(tokenizer, NUM_PROMPTS, (64, 128), seed=0)
    steps = [
        ("greedy", lambda: bench_greedy(prompts)),
        ("ngram", lambda: bench_ngram(tokenizer)),
        ("concurrency", lambda: bench_concurrency(tokenizer)),
        ("temperature", lambda: bench_temperature(prompts)),
    ]
    for name, fn in steps:
        if name in which:
            results[name] = fn()
            out_path.parent.mkdir(exist_ok=True)
            out_path.write_text(json.dumps(results, indent=1) + "\n")  # each result as soon as it exists
    write_section(section, render(results))
    print("\n".join(str(p) for p in plot(results, img)))


def _fixed_k_points(rows: dict) -> tuple[list[int], list[float]]:
    """(k, mean accepted length) of the ``fixed k=N`` rows, by k."""
    pts = sorted(
        (int(name.split("=")[1]), r["mean_accepted_length"]) for name, r in rows.items() if name.startswith("fixed k=")
    )
    return [k for k, _ in pts], [m for _, m in pts]


def _save(plt, fig, ax, path: Path, stamp: str) -> Path:
    """Grid, legend and the command and date in a corner; write ``path``."""
    ax.grid(alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, f"bench/bench_spec.py, {stamp}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(r: dict, folder: Path) -> list[Path]:
    """Draw the plots the results allow into ``folder``; returns the files written.

    ``spec_concurrency.png``: output tokens/s against concurrency, plain and speculative
    (section 3). ``spec_accepted_length.png``: mean accepted length (tokens per verify step)
    against a fixed k for the draft model (section 1) and n-gram lookup (section 2), with the
    ideal k + 1 for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    tail = "" if is_default_model(r.get("model")) else f"_{model_slug(r['model'])}"  # another target's plots
    written = []
    stamp = f"{r.get('date', '')}, {r.get('machine', '')}"
    if r.get("concurrency"):
        rows = r["concurrency"]
        c = [row["concurrency"] for row in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(c, [row["plain_tokens_per_s"] for row in rows], "o-", label="plain decoding")
        ax.plot(c, [row["spec_tokens_per_s"] for row in rows], "s-", label="speculative (default draft, adaptive k)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Throughput against concurrency (default pair, float32, CPU)", fontsize=10)
        written.append(_save(plt, fig, ax, folder / f"spec_concurrency{tail}.png", rows[0].get("date", "")))
    series = []
    if "greedy" in r:
        series.append(("draft model (batch 1, greedy)", *_fixed_k_points(r["greedy"]["spec"])))
    if "ngram" in r:
        series.append(
            (
                "n-gram lookup (edit prompt, greedy)",
                *_fixed_k_points({k: v for k, v in r["ngram"].items() if isinstance(v, dict)}),
            )
        )
    series = [s for s in series if s[1]]
    if series:
        fig, ax = plt.subplots(figsize=(6, 4))
        top = max(max(ks) for _, ks, _ in series)
        ax.plot(
            range(1, top + 1),
            [k + 1 for k in range(1, top + 1)],
            ":",
            color="grey",
            label="every draft accepted (k + 1)",
        )
        for (label, ks, means), marker in zip(series, "os", strict=False):
            ax.plot(ks, means, marker + "-", label=label)
        ax.set_xticks(range(1, top + 1))
        ax.set_xlabel("draft tokens per step (fixed k)")
        ax.set_ylabel("mean accepted length (tokens per verify step)")
        ax.set_title("Accepted length against k", fontsize=10)
        written.append(_save(plt, fig, ax, folder / f"spec_accepted_length{tail}.png", stamp))
    return written


def _spec_rows(rows: dict, ref_name: str) -> list[str]:
    lines = [
        f"| configuration | tokens/s | speedup vs {ref_name} | acceptance rate | mean accepted length | same tokens |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        same = r.get("same_tokens_as_plain", "n/a (sampled)")
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | **{r['speedup_vs_plain']:.2f}x** | {r['acceptance_rate']:.3f} | "
            f"{r['mean_accepted_length']:.2f} | {same} |"
        )
    return lines


def render(r: dict) -> str:
    model = r.get("model")
    lines = [
        "## Speculative decoding ("
        + ("default pair" if is_default_model(model) else model_label(model))
        + ", float32, CPU)",
        "",
        f"Command: `python bench/bench_spec.py{'' if is_default_model(model) else f' --model {model}'}` — "
        f"{r.get('date')}, {r.get('machine')}",
        "",
        "Acceptance rate = accepted / proposed draft tokens; mean accepted length = tokens emitted",
        "per verification step (1 + accepted / steps), as vLLM reports it.",
        "",
    ]
    if "greedy" in r:
        g = r["greedy"]
        lines += [
            f"### 1. Batch 1, greedy, {g['prompts']} held-out prompts one after another, {g['new_tokens']} new tokens each",
            "",
            f"Plain decoding: {g['plain_tokens_per_s']:.1f} tokens/s.",
            "",
            *_spec_rows(g["spec"], "plain"),
            "",
            "| reference | tokens/s | draftwise adaptive speculation vs it |",
            "| --- | --- | --- |",
            f"| draftwise plain decoding | {g['plain_tokens_per_s']:.1f} | **{g['speedup_vs_plain']:.2f}x** (goal 1.8x) |",
            f"| transformers assisted generation, same pair | {g['hf_assisted_tokens_per_s']:.1f} | "
            f"**{g['speedup_vs_hf_assisted']:.2f}x** (goal 2x) |",
            f"| transformers `generate` (no assistant) | {g['hf_generate_tokens_per_s']:.1f} | {g['speedup_vs_hf_generate']:.2f}x |",
            "",
            f"transformers' outputs equal ours: plain {g['hf_generate_same_tokens']}, assisted {g['hf_assisted_same_tokens']}.",
            "",
            'Why the goals are missed: docs/benchmarks.md, "Goals" (from the profile section).',
            "",
        ]
    if "ngram" in r:
        n = r["ngram"]
        rows = {k: v for k, v in n.items() if isinstance(v, dict)}
        lines += [
            f"### 2. N-gram prompt lookup: repeat a block of held-out code with one name changed ({n['prompt_tokens']}-token prompt, {NEW_TOKENS} new tokens, greedy)",
            "",
            f"Plain decoding: {n['plain_tokens_per_s']:.1f} tokens/s.",
            "",
            *_spec_rows(rows, "plain"),
            "",
        ]
    if "concurrency" in r:
        lines += [
            "### 3. Throughput with and without speculation (adaptive policy), greedy, 128 new tokens, held-out prompts of 32-256 tokens",
            "",
            *(
                [
                    f"Command: `python bench/bench_spec.py --only concurrency --threads {c0['threads']}` — {c0.get('date')}",
                    "",
                ]
                if (c0 := r["concurrency"][0]).get("threads")
                else []
            ),
            "| concurrency | requests | plain tokens/s | speculative tokens/s | ratio (goal >= 0.95) | acceptance rate | mean accepted length |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in r["concurrency"]:
            lines.append(
                f"| {c['concurrency']} | {c['requests']} | {c['plain_tokens_per_s']:.1f} | {c['spec_tokens_per_s']:.1f} | "
                f"**{c['ratio']:.2f}x** | {c['acceptance_rate']:.3f} | {c['mean_accepted_length']:.2f} |"
            )
        lines += [
            "",
            "Each request's k is decided at the margin: its k more tokens in the forward pass and its",
            "draft steps (which the whole batch waits for) against the tokens it adds. From 4 streams",
            "up the default draft rarely pays that way on 2 CPU cores, and the engine mostly decodes",
            "plainly (a timed plain step now and then keeps the cost model current); where the policy",
            "proposes nothing, what separates the columns is run-to-run noise, +-5% or more on this",
            "shared machine (each figure is the faster of two alternating runs). The cost model once",
            "extrapolated in proportion from the nearest measured size, which made verifying look",
            "dearer than it is at batch 1, and assumed every request drafts the same k, which made",
            "drafting look as good at batch 4 as at batch 1 (0.7x at 4 streams); both are fixed.",
            "",
        ]
    if "temperature" in r:
        t = r["temperature"]
        rows = {k: v for k, v in t.items() if isinstance(v, dict)}
        lines += [
            "### 4. Temperature 0.7 (seeded), batch 1, same prompts as 1",
            "",
            f"Plain decoding: {t['plain_tokens_per_s']:.1f} tokens/s.",
            "",
            *_spec_rows(rows, "plain"),
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
