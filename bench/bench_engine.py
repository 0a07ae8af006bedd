"""Engine benchmarks on the embedded default target (or ``--model``), each ratio measured in one run:

1. ``single``: one request, 256 new tokens, greedy: tokens/s against transformers
   ``generate`` on the same checkpoint, and against the roofline (copy bandwidth / weight bytes).
2. ``batch``: 64 requests, prompts 16-512 and outputs 16-256 tokens: output tokens/s
   against transformers ``generate`` as one padded static batch and ``generate_batch``.
3. ``itl``: inter-token latency of 8 running streams while a 2,000-token prompt arrives,
   chunked prefill on and off.

    python bench/bench_engine.py [--model MODEL] [--only single,batch,itl] [--threads 2]

Results go to docs/benchmarks.md (section ``engine``) and bench/results/engine.json; with
another ``--model``, to section ``engine-<model>`` and bench/results/engine_<model>.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    ROOT,
    add_model_argument,
    copy_bandwidth,
    for_model,
    heldout_prompts,
    hf_causal_lm,
    is_default_model,
    machine,
    model_label,
    write_section,
)

from draftwise.worker import LLM, SamplingParams  # noqa: E402


def bench_single(llm: LLM, hf, repeats: int = 3) -> dict:
    tok = llm.get_tokenizer()
    prompt = heldout_prompts(tok, 1, (64, 64), seed=0)[0]
    n = 256
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    ours = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        ours.append(time.perf_counter() - t)
    assert len(out.outputs[0].token_ids) == n
    ids = torch.tensor([prompt])
    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **gen)
        theirs = []
        for _ in range(repeats):
            t = time.perf_counter()
            hf_out = hf.generate(ids, **gen)
            theirs.append(time.perf_counter() - t)
    same = hf_out[0, len(prompt) :].tolist() == out.outputs[0].token_ids
    bw = copy_bandwidth()
    weight_bytes = llm.engine.loaded.weight_bytes
    roofline = bw / weight_bytes
    ours_tps = n / statistics.median(ours)
    hf_tps = n / statistics.median(theirs)
    return {
        "prompt_tokens": len(prompt),
        "new_tokens": n,
        "ours_tokens_per_s": ours_tps,
        "hf_generate_tokens_per_s": hf_tps,
        "speedup_vs_hf": ours_tps / hf_tps,
        "copy_bandwidth_gb_s": bw / 1e9,
        "weight_mb": weight_bytes / 1e6,
        "roofline_tokens_per_s": roofline,
        "fraction_of_roofline": ours_tps / roofline,
        "same_tokens_as_hf": same,
    }


def bench_batch(llm: LLM, hf, n: int = 64) -> dict:
    import random

    tok = llm.get_tokenizer()
    prompts = heldout_prompts(tok, n, (16, 512), seed=1)
    rng = random.Random(2)
    outs = [rng.randint(16, 256) for _ in range(n)]
    useful = sum(outs)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    ours_s = time.perf_counter() - t
    assert sum(len(r.outputs[0].token_ids) for r in res) == useful

    # transformers generate: one left-padded static batch, running to the longest output
    width = max(len(p) for p in prompts)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(outs)
    with torch.no_grad():
        t = time.perf_counter()
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        static_s = time.perf_counter() - t

    # transformers generate_batch: continuous batching (one max_new_tokens for all requests)
    from transformers import GenerationConfig

    gb_s = None
    gb_error = None
    try:
        cfg = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            t = time.perf_counter()
            gb = hf.generate_batch(inputs=prompts, generation_config=cfg)
            gb_s = time.perf_counter() - t
        gb_tokens = sum(len(o.generated_tokens) for o in gb.values())
    except Exception as e:  # recorded as it is
        gb_error = f"{type(e).__name__}: {e}"[:300]
        gb_tokens = 0
    r = {
        "requests": n,
        "useful_output_tokens": useful,
        "ours_s": ours_s,
        "ours_tokens_per_s": useful / ours_s,
        "hf_static_s": static_s,
        "hf_static_useful_tokens_per_s": useful / static_s,
        "hf_static_generated_tokens_per_s": n * longest / static_s,
        "speedup_vs_hf_static": static_s / ours_s,
    }
    if gb_s is not None:
        r.update(
            hf_generate_batch_s=gb_s,
            hf_generate_batch_useful_tokens_per_s=useful / gb_s,
            hf_generate_batch_generated_tokens_per_s=gb_tokens / gb_s,
            speedup_vs_hf_generate_batch=gb_s / ours_s,
        )
    else:
        r["hf_generate_batch_error"] = gb_error
    return r


def bench_itl(chunked: bool, budget: int, model: str | None = None) -> dict:
    llm = LLM(
        model=model, dtype="float32", enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else None
    )
    engine = llm.engine
    tok = llm.get_tokenizer()
    streams = heldout_prompts(tok, 8, (64, 64), seed=3)
    (long_prompt,) = heldout_prompts(tok, 1, (2000, 2000), seed=4)
    for i, p in enumerate(streams):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    last: dict[str, float] = {}
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    steps = 0
    prefill_done_at = None
    added = False
    while engine.has_unfinished_requests():
        out = engine.step()
        now = time.perf_counter()
        steps += 1
        long_active = added and prefill_done_at is None
        for d in out.deltas:
            if d.request_id.startswith("s") and d.token_ids:
                if d.request_id in last:
                    (gaps_during if long_active else gaps_before).append(now - last[d.request_id])
                last[d.request_id] = now
            if d.request_id == "long" and d.token_ids and prefill_done_at is None:
                prefill_done_at = steps
        if steps == 40 and not added:
            engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            added = True
        if prefill_done_at is not None and steps > prefill_done_at + 5:
            for i in range(8):
                engine.abort_request(f"s{i}")

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

    return {
        "chunked_prefill": chunked,
        "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
        "itl_ms_before_p50": pct(gaps_before, 0.5),
        "itl_ms_during_p50": pct(gaps_during, 0.5),
        "itl_ms_during_p99": pct(gaps_during, 0.99),
        "itl_ms_during_max": pct(gaps_during, 1.0),
        "steps_to_prefill": prefill_done_at - 40 if prefill_done_at else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(ap)
    ap.add_argument("--only", default="single,batch,itl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--itl-budget", type=int, default=256, help="max_num_batched_tokens with chunked prefill")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    which = set(args.only.split(","))
    results: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    if not is_default_model(args.model):
        results["model"] = args.model
    out_path = ROOT / "bench" / "results" / f"{for_model('engine', args.model, '_')}.json"
    if out_path.exists():
        results = {**json.loads(out_path.read_text()), **results}
    hf = hf_causal_lm(args.model) if which & {"single", "batch"} else None
    if which & {"single", "batch"}:
        llm = LLM(model=args.model, dtype="float32")
        if "single" in which:
            results["single"] = bench_single(llm, hf)
            print(json.dumps(results["single"], indent=1), flush=True)
        if "batch" in which:
            results["batch"] = bench_batch(llm, hf)
            print(json.dumps(results["batch"], indent=1), flush=True)
        del llm
    if "itl" in which:
        results["itl"] = [bench_itl(True, args.itl_budget, args.model), bench_itl(False, 0, args.model)]
        print(json.dumps(results["itl"], indent=1), flush=True)
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    write_section(for_model("engine", args.model), render(results))


def render(r: dict) -> str:
    model = r.get("model")
    flag = "" if is_default_model(model) else f" --model {model}"
    lines = [
        # the default model's weights are float32; a GGUF file's stay as the engine's default keeps them (auto)
        f"## Engine ({model_label(model)}, float32, CPU"
        + ("" if is_default_model(model) else "; weights as quantization='auto' keeps them")
        + ")",
        "",
        f"Command: `python bench/bench_engine.py{flag}` — {r.get('date')}, {r.get('machine')}",
        "",
    ]
    if "single" in r:
        s = r["single"]
        lines += [
            "### 1. One request, 256 new tokens, greedy",
            "",
            "| measure | value |",
            "| --- | --- |",
            f"| draftwise tokens/s | {s['ours_tokens_per_s']:.1f} |",
            f"| transformers `generate` tokens/s | {s['hf_generate_tokens_per_s']:.1f} |",
            f"| **speedup vs transformers** (goal >= 2.5x) | **{s['speedup_vs_hf']:.2f}x** |",
            f"| copy bandwidth | {s['copy_bandwidth_gb_s']:.1f} GB/s |",
            f"| weights | {s['weight_mb']:.1f} MB |",
            f"| roofline (bandwidth / weight bytes) | {s['roofline_tokens_per_s']:.0f} tokens/s |",
            f"| **fraction of roofline** (goal >= 0.5) | **{s['fraction_of_roofline']:.3f}** |",
            f"| same tokens as transformers | {s['same_tokens_as_hf']} |",
            "",
        ]
    if "batch" in r:
        b = r["batch"]
        lines += [
            "### 2. 64 requests, prompts 16-512, outputs 16-256 tokens, greedy",
            "",
            "Throughput counts the tokens the requests asked for (`useful`). transformers has one",
            "`max_new_tokens` per call, so both of its runs generate the longest output for every request.",
            "",
            "| system | seconds | useful output tokens/s | ratio draftwise / it |",
            "| --- | --- | --- | --- |",
            f"| draftwise | {b['ours_s']:.1f} | {b['ours_tokens_per_s']:.1f} | 1 |",
            f"| transformers `generate`, static padded batch | {b['hf_static_s']:.1f} | {b['hf_static_useful_tokens_per_s']:.1f} | **{b['speedup_vs_hf_static']:.2f}x** (goal >= 2x) |",
        ]
        if "hf_generate_batch_s" in b:
            lines.append(
                f"| transformers `generate_batch` | {b['hf_generate_batch_s']:.1f} | {b['hf_generate_batch_useful_tokens_per_s']:.1f} | **{b['speedup_vs_hf_generate_batch']:.2f}x** (goal 5x) |"
            )
        else:
            lines.append(f"| transformers `generate_batch` | failed: `{b.get('hf_generate_batch_error')}` | | |")
        lines.append("")
    if "itl" in r:
        lines += [
            "### 3. Inter-token latency of 8 streams while a 2,000-token prompt arrives",
            "",
            "| chunked prefill | token budget | ITL p50 before (ms) | ITL p50 during (ms) | p99 during (ms) | max during (ms) | steps to prefill |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for x in r["itl"]:
            lines.append(
                f"| {'on' if x['chunked_prefill'] else 'off'} | {x['max_num_batched_tokens']} | {x['itl_ms_before_p50']:.1f} | "
                f"{x['itl_ms_during_p50']:.1f} | {x['itl_ms_during_p99']:.1f} | {x['itl_ms_during_max']:.1f} | {x['steps_to_prefill']} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
