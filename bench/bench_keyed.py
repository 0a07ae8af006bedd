"""Keyed sampling: what it costs and what seeded speculation gives up, measured in one run.

1. ``acceptance``: the embedded default pair (draft model, fixed k = 3 and k = 5), held-out
   prompts, at temperature 0.7 and 1.0: acceptance rate and mean accepted length of seeded
   requests (Gumbel coupling: exact, output equal to plain seeded sampling) against unseeded
   ones (rejection sampling: exact in distribution only).
2. ``noise``: the sampler's randomness for a [rows, vocab] batch: keyed noise (one batched
   computation) against the previous per-request ``torch.Generator`` draws (one
   ``exponential_`` call per row), and the whole ``Sampler`` call with each.

    python bench/bench_keyed.py [--only acceptance,noise] [--threads 2] [--ks 3,5] [--prompts 8] [--tokens 128]

Results go to bench/results/keyed.json and are printed as tables (docs/engine.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, heldout_prompts, machine  # noqa: E402

from draftwise.worker import LLM, SamplingParams  # noqa: E402
from draftwise.worker import sampler as sampler_mod  # noqa: E402
from draftwise.worker.keyed_random import STREAM_SAMPLE, keyed_exponential  # noqa: E402

NUM_PROMPTS = 8
NEW_TOKENS = 128


def bench_acceptance(ks: list[int], num_prompts: int, new_tokens: int) -> list[dict]:
    rows = []
    for k in ks:
        llm = LLM(dtype="float32", speculative_model="default", num_speculative_tokens=k, speculative_adaptive=False)
        prompts = heldout_prompts(llm.get_tokenizer(), num_prompts, (64, 128), seed=0)
        for temp in (0.7, 1.0):
            for scheme, seeded in (("rejection sampling (unseeded)", False), ("Gumbel coupling (seeded)", True)):
                params = [
                    SamplingParams(temperature=temp, max_tokens=new_tokens, ignore_eos=True, seed=i if seeded else None)
                    for i in range(len(prompts))
                ]
                outs = llm.generate(prompts, params, use_tqdm=False)
                prop = sum(o.outputs[0].num_spec_proposed for o in outs)
                acc = sum(o.outputs[0].num_spec_accepted for o in outs)
                steps = sum(o.outputs[0].spec.verify_steps for o in outs if o.outputs[0].spec is not None)
                rows.append(
                    {
                        "k": k,
                        "prompts": num_prompts,
                        "new_tokens": new_tokens,
                        "temperature": temp,
                        "scheme": scheme,
                        "proposed": prop,
                        "accepted": acc,
                        "acceptance_rate": acc / prop if prop else 0.0,
                        "mean_accepted_length": 1 + acc / steps if steps else 0.0,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def _time(fn, repeats: int = 30) -> float:
    """The fastest of ``repeats`` runs: on a shared machine, interference only adds time."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _generator_noise(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """The previous sampler's randomness: each row from its own generator, one call per row."""
    noise = torch.ones_like(probs)
    for i, g in enumerate(gens):
        noise[i].exponential_(generator=g)
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def bench_noise(vocab: int = 8192) -> list[dict]:
    out = []
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    for rows in (1, 8, 64, 256):
        logits = torch.randn(rows, vocab)
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        srows = [sampler_mod.SamplingRow(params, i, [1, 2, 3], [4] * 10) for i in range(rows)]
        probs = sampler_mod.processed_probs(logits, srows)
        positions = [r.position for r in srows]
        old_noise = _time(lambda: _generator_noise(probs, gens))  # noqa: B023
        new_noise = _time(lambda: keyed_exponential(list(range(rows)), positions, STREAM_SAMPLE, vocab))  # noqa: B023
        new_call = _time(lambda: sampler_mod.Sampler()(logits, srows))  # noqa: B023
        old_call = _time(
            lambda: (sampler_mod.processed_probs(logits, srows) / _generator_noise(probs, gens)).argmax(-1).tolist()  # noqa: B023
        )
        out.append(
            {
                "rows": rows,
                "vocab": vocab,
                "generator_noise_ms": old_noise * 1e3,
                "keyed_noise_ms": new_noise * 1e3,
                "noise_speedup": old_noise / new_noise,
                "sampler_with_generators_ms": old_call * 1e3,
                "sampler_keyed_ms": new_call * 1e3,
                "sampler_speedup": old_call / new_call,
            }
        )
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="acceptance,noise")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default="3,5", help="acceptance: fixed k values")
    ap.add_argument("--prompts", type=int, default=NUM_PROMPTS, help="acceptance: held-out prompts (one batch)")
    ap.add_argument("--tokens", type=int, default=NEW_TOKENS, help="acceptance: new tokens per prompt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    which = set(args.only.split(","))
    out_path = ROOT / "bench" / "results" / "keyed.json"
    results: dict = json.loads(out_path.read_text()) if out_path.exists() else {}
    results.update({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "threads": args.threads})
    if "noise" in which:
        results["noise"] = bench_noise()
    if "acceptance" in which:
        results["acceptance"] = bench_acceptance([int(k) for k in args.ks.split(",")], args.prompts, args.tokens)
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
