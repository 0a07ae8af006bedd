"""Keyed sampling: what it costs and what seeded speculation gives up, measured in one run.

1. ``acceptance``: the embedded default pair (draft model, fixed k = 3 and k = 5), held-out
   prompts, at temperature 0.7 and 1.0: acceptance rate and mean accepted length of seeded
   requests (Gumbel coupling: exact, output equal to plain seeded sampling) against unseeded
   ones (rejection sampling: exact in distribution only).
2. ``paired``: the same comparison on identical contexts: held-out text scored by target and
   draft (teacher forcing), and at every position rejection sampling's acceptance
   probability ``sum min(p, q)`` against the coupling's ``P(argmax(p / E) == argmax(q / E))``
   (estimated over 64 seeds of the keyed noise).
3. ``noise``: the sampler's randomness for a [rows, vocab] batch: keyed noise (one batched
   computation) against the previous per-request ``torch.Generator`` draws (one
   ``exponential_`` call per row), and the whole ``Sampler`` call with each.

    python bench/bench_keyed.py [--only acceptance,paired,noise] [--threads 2] [--ks 3,5] [--prompts 8] [--tokens 128]

Results go to bench/results/keyed.json and are printed as tables (docs/engine.md quotes them).
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
from benchlib import ROOT, heldout_prompts, machine  # noqa: E402

from draftwise.worker import LLM, SamplingParams, default_model_path  # noqa: E402
from draftwise.worker import sampler as sampler_mod  # noqa: E402
from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk  # noqa: E402
from draftwise.worker.sampling.keyed_random import STREAM_SAMPLE, keyed_exponential  # noqa: E402

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


def _all_logits(which: str, texts: list[list[int]]) -> torch.Tensor:  # [positions, vocab]
    loaded = load_model(default_model_path(which), dtype="float32")
    n = max(len(t) for t in texts)
    runner = ModelRunner(loaded, KVCache(loaded.config, -(-n // 16), 16, loaded.dtype, "cpu"))
    out = [runner.run([SequenceChunk(t, 0, list(range(-(-n // 16))), len(t))]) for t in texts]
    return torch.cat(out).float()


def bench_paired(num_texts: int = 4, length: int = 256, seeds: int = 64) -> list[dict]:
    tokenizer = LLM(dtype="float32").get_tokenizer()
    texts = heldout_prompts(tokenizer, num_texts, (length, length), seed=1)
    target, draft = _all_logits("target", texts), _all_logits("draft", texts)
    vocab = target.shape[1]
    if draft.shape[1] < vocab:
        draft = torch.nn.functional.pad(draft, (0, vocab - draft.shape[1]), value=-torch.inf)
    rows = []
    for temp in (0.7, 1.0):
        p, q = (target / temp).softmax(-1), (draft / temp).softmax(-1)  # [positions, vocab]
        rejection = float(torch.minimum(p, q).sum(-1).mean())
        agree = 0.0
        for s in range(seeds):
            e = keyed_exponential([s] * p.shape[0], list(range(p.shape[0])), STREAM_SAMPLE, vocab).clamp_min(1e-38)
            agree += float(((p / e).argmax(-1) == (q / e).argmax(-1)).double().mean())
        rows.append(
            {
                "temperature": temp,
                "positions": p.shape[0],
                "seeds": seeds,
                "rejection_sampling_acceptance": rejection,
                "gumbel_coupling_acceptance": agree / seeds,
                "ratio": agree / seeds / rejection,
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
    ap.add_argument("--only", default="acceptance,paired,noise")
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
    if "paired" in which:
        results["paired"] = bench_paired()
    if "acceptance" in which:
        results["acceptance"] = bench_acceptance([int(k) for k in args.ks.split(",")], args.prompts, args.tokens)
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
