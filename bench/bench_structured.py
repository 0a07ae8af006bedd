"""Structured output (issue 27): the cost of a JSON-schema constraint against free decoding,
in-process, greedy, float32 on CPU; every ratio from measurements of the same run.

The constraint is one moderate schema (6 properties, all required: two bounded strings, an
integer range, a boolean, an enum, an array of up to 3 enum strings; ``SCHEMA``). Each request
has its own short prompt naming the fields. Two modes on one engine:

- ``free``: the same prompts, ``max_tokens`` new tokens each (``ignore_eos``: a fixed length);
- ``json_schema``: the constraint, the same ``max_tokens`` (``ignore_eos`` is refused with a
  constraint, so a request ends when its JSON is complete or at ``max_tokens``).

At each concurrency C (closed loop: C requests in the engine, the next added when one finishes,
so the batch stays full while requests remain) each mode runs ``--repeats`` times in turned order,
keeping its fastest run. Reported per mode: output tokens/s (output tokens over wall time), the
median time of a full decode step (C rows, one token each), and for the constrained mode the
grammar's mask time (the engine's ``grammars.mask_seconds``: filling the bitmasks on the host and
applying them) as a fraction of step time (goal: <= 10%), plus how many outputs completed their
JSON and validated.

    python bench/bench_structured.py [--model MODEL] [--concurrency 1,32] [--requests 64]
        [--max-tokens 96] [--repeats 2] [--threads 2] [--no-publish]

Run it on a quiet machine (nothing else busy): every figure is a ratio of runs in one process.
Results: docs/benchmarks.md (section ``structured``, or ``structured-<model>``) and
bench/results/structured[_<model>].json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    MODEL_HELP,
    for_model,
    is_default_model,
    machine,
    model_label,
    save_results,
    write_section,
)

from draftwise.logs import configure_logging  # noqa: E402
from draftwise.worker import LLM, SamplingParams  # noqa: E402
from draftwise.worker.sampling.constraints import Constraint  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "new"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "active", "role", "tags"],
    "additionalProperties": False,
}
MODES = ("free", "json_schema")
QUIET_LOAD = 0.5
"""1-minute load average above which the machine is not quiet (the benchmark warns)."""


def prompts(n: int) -> list[str]:
    fields = ", ".join(SCHEMA["properties"])
    return [f"# Record {i}: a person as JSON with {fields}\nrecord = " for i in range(n)]


def params(mode: str, n: int, max_tokens: int) -> list[SamplingParams]:
    if mode == "free":
        return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in range(n)]
    c = Constraint.json_schema(SCHEMA)
    return [SamplingParams(temperature=0, max_tokens=max_tokens, constraint=c) for _ in range(n)]


def mask_seconds(llm: LLM) -> float | None:
    """The engine's cumulative mask time, or None when it exposes none."""
    grammars = getattr(llm.engine, "grammars", None)
    value = getattr(grammars, "mask_seconds", None)
    return float(value) if value is not None else None


def run(llm: LLM, texts: list[str], ps: list[SamplingParams], concurrency: int) -> dict:
    """Closed loop at ``concurrency``; wall time, step times, outputs."""
    engine = llm.engine
    queue = list(enumerate(zip(texts, ps, strict=True)))
    outs: dict[str, Any] = {}
    steps: list[tuple[int, int, float]] = []  # (rows, tokens, seconds)
    mask0 = mask_seconds(llm)
    t0 = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            i, (text, p) = queue.pop(0)
            engine.add_request(f"c{concurrency}-{i}", text, p)
        ts = time.perf_counter()
        res = engine.step()
        seconds = time.perf_counter() - ts
        st = res.stats
        steps.append((st.num_scheduled, st.num_batched_tokens, seconds) if st is not None else (0, 0, seconds))
        for o in res.finished:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            outs[o.request_id] = o
    wall = time.perf_counter() - t0
    engine.check_idle_invariants()
    mask1 = mask_seconds(llm)
    return {
        "seconds": wall,
        "steps": steps,
        "outputs": [outs[f"c{concurrency}-{i}"] for i in range(len(texts))],
        "mask_seconds": None if mask0 is None or mask1 is None else mask1 - mask0,
    }


def summarize(mode: str, concurrency: int, r: dict) -> dict:
    import jsonschema

    outs = [o.outputs[0] for o in r["outputs"]]
    tokens = sum(len(c.token_ids) for c in outs)
    full = [s for rows, n, s in r["steps"] if rows == concurrency and n == concurrency]
    step_s = sum(s for _, _, s in r["steps"])
    row = {
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(outs),
        "output_tokens": tokens,
        "seconds": r["seconds"],
        "tokens_per_s": tokens / r["seconds"],
        "steps": len(r["steps"]),
        "full_decode_steps": len(full),
        "median_full_step_ms": 1e3 * statistics.median(full) if full else None,
        "step_seconds": step_s,
    }
    if mode == "json_schema":
        validator = jsonschema.Draft202012Validator(SCHEMA)
        complete = [c for c in outs if c.finish_reason == "stop" and not c.constraint_unfinished]
        valid = 0
        for c in complete:
            with contextlib.suppress(json.JSONDecodeError):
                valid += validator.is_valid(json.loads(c.text))
        row |= {"complete": len(complete), "valid": valid, "mask_seconds": r["mask_seconds"]}
        row["mask_fraction"] = None if r["mask_seconds"] is None else r["mask_seconds"] / step_s
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--requests", type=int, default=64, help="requests per run (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load > QUIET_LOAD:
        print(f"warning: load average {load:.2f}: the machine is busy, timings are not comparable", file=sys.stderr)
    torch.set_num_threads(args.threads)
    configure_logging("console", "warning")
    levels = [int(c) for c in args.concurrency.split(",")]
    base: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": max(levels)}
    if not is_default_model(args.model):
        base["model"] = args.model
    llm = LLM(**base)
    for mode in MODES:  # warm-up: first calls allocate, the schema compiles once (cached after)
        run(llm, prompts(2), params(mode, 2, 8), 2)
    rows = []
    for c in levels:
        n = max(args.requests, c)
        texts = prompts(n)
        best: dict[str, dict] = {}
        for rep in range(args.repeats):
            order = MODES[rep % 2 :] + MODES[: rep % 2]
            for mode in order:
                r = run(llm, texts, params(mode, n, args.max_tokens), c)
                if mode not in best or r["seconds"] < best[mode]["seconds"]:
                    best[mode] = r
        free = summarize("free", c, best["free"])
        con = summarize("json_schema", c, best["json_schema"])
        con["vs_free"] = con["tokens_per_s"] / free["tokens_per_s"]
        if con["median_full_step_ms"] and free["median_full_step_ms"]:
            con["step_vs_free"] = con["median_full_step_ms"] / free["median_full_step_ms"]
        rows += [free, con]
        print(free, con, sep="\n", flush=True)
    result = {
        "command": "python bench/bench_structured.py " + shlex.join(sys.argv[1:]),
        "machine": machine(),
        "load_average": load,
        "schema": SCHEMA,
        "rows": rows,
    }
    body = render(result, args)
    print(body)
    if not args.no_publish:
        save_results(for_model("structured", args.model, "_"), result)
        write_section(for_model("structured", args.model), body)


def _f(x: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{unit}"


def render(r: dict, args: argparse.Namespace) -> str:
    lines = [
        f"## Structured output: a JSON-schema constraint against free decoding ({model_label(args.model)}, float32, CPU)",
        "",
        f"Command: `{r['command']}` — {time.strftime('%Y-%m-%d')}, {r['machine']}, load average {r['load_average']:.2f}",
        "",
        f"In-process `LLM`, greedy, at most {args.max_tokens} new tokens, closed loop; each mode's fastest of"
        f" {args.repeats} runs in turned order. `free`: `ignore_eos`, exactly {args.max_tokens} tokens;"
        " `json_schema`: a 6-property schema (bounded strings, an integer range, a boolean, an enum, an array of"
        " enums), ending when the JSON is complete. A full decode step: every one of the C rows decoding one token."
        " Mask time: the engine's own counter (bitmasks filled on the host and applied). See bench/bench_structured.py.",
        "",
        "| concurrency | mode | output tok/s | vs free | median full decode step | vs free | mask time / step time"
        " | complete and valid |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for x in r["rows"]:
        con = x["mode"] == "json_schema"
        valid = f"{x['valid']}/{x['complete']} of {x['requests']}" if con else ""
        lines.append(
            f"| {x['concurrency']} | {x['mode']} | {x['tokens_per_s']:.1f} |"
            f" {_f(x.get('vs_free'), '.2f', 'x') if con else ''} |"
            f" {_f(x['median_full_step_ms'], '.2f', ' ms')} ({x['full_decode_steps']} steps) |"
            f" {_f(x.get('step_vs_free'), '.2f', 'x') if con else ''} |"
            f" {_f(x.get('mask_fraction'), '.1%') if con else ''} |"
            f" {valid} |"
        )
    lines.append("")
    for x in r["rows"]:
        if x["mode"] != "json_schema":
            continue
        frac = x.get("mask_fraction")
        if frac is None:
            step = x.get("step_vs_free")
            frac = None if step is None else step - 1
            how = "full decode step time against free decoding's (the engine exposes no mask counter)"
        else:
            how = "mask time over step time"
        verdict = "n/a" if frac is None else "met" if frac <= 0.10 else "**NOT met**"
        lines.append(
            f"- concurrency {x['concurrency']}: mask cost {_f(frac, '.1%')} of a step ({how}; goal <= 10%): {verdict}."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
