"""Trained draft heads (EAGLE, Medusa) against plain decoding, n-gram lookup and the draft
model, on the held-out evaluation prompts of ``bench/head_eval_prompts.py`` (24 prompts: chat,
code, reasoning), float32 on CPU; every ratio comes from measurements of the same run.

One engine per method serves ``--model``. The prompts are rendered with the model's chat
template (its end-of-turn token stops a reply; a model without a template, such as the
embedded code model, gets the prompt as plain text, as its heads were trained). At each
temperature (0: greedy; otherwise seeded sampling, request i with seed i, so every method
emits the same tokens as plain decoding) and each concurrency C, the prompts, repeated to at
least 2C requests, go through every method in a closed loop: C requests in the engine, the
next added when one finishes. Methods alternate (in turned order) ``--repeats`` times and each
keeps its fastest run, so that drift of the shared machine hits all alike.

Reported per (method, temperature, concurrency): output tokens/s; the ratio against plain
decoding of the same run; mean accepted length (per request 1 + accepted / verify steps,
1 without verify steps, averaged over requests weighted by output tokens; plain = 1); tokens
per target forward pass (output tokens / (output tokens - accepted): counts the adaptive
policy's plain steps too); acceptance rate. Per prompt kind, the mean accepted length at
concurrency 1.

``draft`` (the embedded draft model, ``speculative_model="default"``) applies only to the
embedded target: no draft model with another tokenizer installs here. ``eagle``/``medusa``
use the heads shipped for the target (worker/default_models/heads/); when one cannot be
loaded the run stops before measuring (``--quick`` skips it and says why).

    python bench/bench_heads.py --model smollm2-135m-instruct [--methods plain,ngram,draft,medusa,eagle]
        [--concurrency 1,4,16,64] [--max-tokens 128] [--temperatures 0,0.7] [--k K] [--fixed-k]
        [--threads 2] [--repeats 2]
    python bench/bench_heads.py --model default --quick     # smoke: 2 prompts, concurrency 1 and 2, 8 tokens
    python bench/bench_heads.py --model default --replot    # section and plot again from the saved results

Results: bench/results/heads_<model>.json, docs/benchmarks.md (section ``heads-<model>``) and
docs/img/heads_speedup_<model>.svg (speedup over plain decoding against concurrency, one line
per method and temperature). ``--quick`` writes all three into a temporary folder instead.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import _llm  # noqa: E402
from benchlib import MODEL_HELP, ROOT, is_default_model, machine, model_slug, write_section  # noqa: E402
from head_eval_prompts import ALL  # noqa: E402

from draftwise.logs import configure_logging  # noqa: E402
from draftwise.worker import LLM, SamplingParams  # noqa: E402
from draftwise.worker.text.chat import ChatPrompt  # noqa: E402

METHODS = ("plain", "ngram", "draft", "medusa", "eagle")
PROMPT_ROOM = 256  # context for the prompt (the rendered evaluation prompts are well under it)
NO_DRAFT = "no draft model with this tokenizer installs here (the embedded draft pairs with the embedded target only)"


def method_spec(method: str, k: int | None, fixed: bool, head_dir: Path | None) -> dict:
    """EngineConfig fields of ``method`` (beyond model and dtype)."""
    if method == "plain":
        return {}
    spec: dict = {"speculative_method": method}
    if method == "draft":
        spec["speculative_model"] = "default"
    elif method in ("eagle", "medusa") and head_dir is not None:
        spec["speculative_model"] = str(head_dir / method)
    if k is not None:
        spec["num_speculative_tokens"] = k
    if fixed:
        spec["speculative_adaptive"] = False
    return spec


def build_engines(args, methods: list[str], max_model_len: int, max_seqs: int) -> tuple[dict[str, LLM], dict]:
    """One LLM per method that can be built; (engines, {method: why skipped})."""
    llms: dict[str, LLM] = {}
    skipped: dict[str, str] = {}
    for m in methods:
        if m == "draft" and not is_default_model(args.model):
            skipped[m] = NO_DRAFT
            continue
        spec = method_spec(m, args.k, args.fixed_k, args.head_dir)
        try:
            weights = {"quantization": args.quantization} if args.quantization else {}
            llms[m] = _llm(model=args.model, max_model_len=max_model_len, max_num_seqs=max_seqs, **weights, **spec)
        except Exception as e:  # a missing head is reported, not fatal: the other methods still run
            if m == "plain":
                raise
            skipped[m] = f"{type(e).__name__}: {e}"
    for m, why in skipped.items():
        print(f"{m}: skipped: {why}", flush=True)
    return llms, skipped


def encode_prompts(llm: LLM, prompts: list[tuple[str, str]]) -> tuple[list[dict], str]:
    """Per prompt {kind, ids, stops}; and how they were rendered."""
    engine = llm.engine
    out = []
    try:
        for kind, p in prompts:
            chat = engine.encode_chat(ChatPrompt.from_messages([{"role": "user", "content": p}]))
            stops = chat.sampling_params(SamplingParams(), engine.eos_token_ids).stop_token_ids
            out.append({"kind": kind, "ids": chat.token_ids, "stops": tuple(stops)})
        return out, "rendered with the model's chat template"
    except ValueError as e:  # no chat template: plain text, as the heads of such a model were trained
        print(f"prompts as plain text: {e}", flush=True)
        plain = [{"kind": k, "ids": engine.encode_prompt(p), "stops": ()} for k, p in prompts]
        return plain, "given as plain text (the model has no chat template)"


def closed_loop(llm: LLM, requests: list[tuple[int, dict]], params: list[SamplingParams], concurrency: int):
    """``requests`` (index into the prompts, prompt) kept ``concurrency`` at a time in the
    engine; (seconds, [(prompt index, final output)] in request order)."""
    engine = llm.engine
    queue = list(enumerate(requests))
    outs: dict[str, object] = {}
    t = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            i, (_, p) = queue.pop(0)
            engine.add_request(f"h{concurrency}-{i}", p["ids"], params[i])
        for o in engine.step().finished:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            outs[o.request_id] = o
    seconds = time.perf_counter() - t
    return seconds, [(pi, outs[f"h{concurrency}-{i}"]) for i, (pi, _) in enumerate(requests)]


def fastest_runs(
    llms: dict[str, LLM], prompts: list[dict], params: list[SamplingParams], concurrency: int, repeats: int
) -> dict[str, tuple[float, list]]:
    """Each method's fastest of ``repeats`` closed-loop runs over ``prompts``, the methods in turned
    order from one repeat to the next: {method: (seconds, final outputs in prompt order)}."""
    best: dict[str, tuple[float, list]] = {}
    order = list(llms)
    for r in range(repeats):
        for m in order[r % len(order) :] + order[: r % len(order)]:
            s, outs = closed_loop(llms[m], list(enumerate(prompts)), params, concurrency)
            if m not in best or s < best[m][0]:
                best[m] = (s, [o for _, o in outs])
    return best


def request_params(requests: list[tuple[int, dict]], temperature: float, max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            stop_token_ids=p["stops"],
            seed=None if temperature == 0 else i,
        )
        for i, (_, p) in enumerate(requests)
    ]


def accept_stats(outs: list) -> dict:
    """Counters of one run's final outputs (see the module docstring)."""
    tokens = proposed = accepted = steps = 0
    weighted = 0.0
    for o in outs:
        c = o.outputs[0]
        n = len(c.token_ids)
        s = c.spec
        p, a, v = (s.proposed, s.accepted, s.verify_steps) if s is not None else (0, 0, 0)
        tokens, proposed, accepted, steps = tokens + n, proposed + p, accepted + a, steps + v
        weighted += n * (1 + a / v if v else 1.0)
    return {
        "output_tokens": tokens,
        "proposed": proposed,
        "accepted": accepted,
        "verify_steps": steps,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": weighted / tokens if tokens else 1.0,
        "tokens_per_target_forward": tokens / (tokens - accepted) if tokens > accepted else 1.0,
    }


def bench_level(
    llms: dict[str, LLM],
    prompts: list[dict],
    concurrency: int,
    temperature: float,
    max_tokens: int,
    repeats: int,
) -> dict:
    """Every method at one (temperature, concurrency): its fastest of ``repeats`` alternating runs."""
    n = max(len(prompts), 2 * concurrency) if concurrency > 1 else len(prompts)
    requests = [(i % len(prompts), prompts[i % len(prompts)]) for i in range(n)]
    params = request_params(requests, temperature, max_tokens)
    best = dict.fromkeys(llms, float("inf"))
    runs: dict[str, list] = {}
    order = list(llms)
    for r in range(repeats):
        for m in order[r % len(order) :] + order[: r % len(order)]:
            s, outs = closed_loop(llms[m], requests, params, concurrency)
            if s < best[m]:
                best[m], runs[m] = s, outs
    plain_outs = [o for _, o in runs["plain"]]
    plain_tps = sum(len(o.outputs[0].token_ids) for o in plain_outs) / best["plain"]
    rows = {}
    for m in llms:
        outs = [o for _, o in runs[m]]
        st = accept_stats(outs)
        tps = st["output_tokens"] / best[m]
        rows[m] = {
            "seconds": best[m],
            "tokens_per_s": tps,
            "speedup_vs_plain": tps / plain_tps,
            "same_tokens_as_plain": [o.outputs[0].token_ids for o in outs]
            == [o.outputs[0].token_ids for o in plain_outs],
            **st,
        }
        if concurrency == 1:  # per prompt kind
            kinds: dict[str, list] = {}
            for pi, o in runs[m]:
                kinds.setdefault(prompts[pi]["kind"], []).append(o)
            rows[m]["by_kind"] = {
                kind: {k: v for k, v in accept_stats(os_).items() if k != "verify_steps"} for kind, os_ in kinds.items()
            }
        print(
            f"T={temperature:g} C={concurrency} {m}: {tps:.1f} tok/s, {rows[m]['speedup_vs_plain']:.2f}x, "
            f"accepted length {st['mean_accepted_length']:.2f}, tokens/forward {st['tokens_per_target_forward']:.2f}, "
            f"same as plain {rows[m]['same_tokens_as_plain']}",
            flush=True,
        )
    return {"concurrency": concurrency, "temperature": temperature, "requests": n, "methods": rows}


def make_random_heads(model: str | None, folder: Path) -> None:
    """Untrained (random) eagle and medusa heads for ``model`` in ``folder``/{eagle,medusa}:
    only to exercise this script (--random-heads); they accept next to nothing."""
    from draftwise.worker.model.loader import load_model
    from draftwise.worker.paths import resolve_model
    from draftwise.worker.speculative.heads import EagleHead, MedusaHeads, head_model_config, save_head

    target = load_model(resolve_model(model), dtype="float32")
    cfg = target.config
    torch.manual_seed(0)
    ids = torch.arange(min(cfg.vocab_size, 8192))
    save_head(folder / "eagle", EagleHead(head_model_config(cfg)), ids, "random test head", target.model)
    save_head(folder / "medusa", MedusaHeads(cfg.hidden_size, 4), ids, "random test head", target.model)


def _weights(r: dict) -> str:
    return "float16 weights" if r.get("quantization") == "fp16" else "float32"


def render(r: dict) -> str:
    slug = r["model_slug"]
    lines = [
        f"## Trained draft heads against plain decoding (`{slug}`, {_weights(r)}, CPU)",
        "",
        f"Command: `{r['command']}` — {r['date']}, {r['machine']}",
        "",
        f"The {r['num_prompts']} held-out prompts of `bench/head_eval_prompts.py` ({', '.join(r['kinds'])}), "
        f"{r['prompt_format']}, up to {r['max_tokens']} new tokens"
        + (" (a reply ends at the end-of-turn token). " if r["chat_template"] else " (or EOS). ")
        + "Closed loop: C requests in the engine, the prompts repeated to at least 2C requests; methods alternate, "
        f"each keeps the fastest of {r['repeats']} runs. Temperature 0: greedy; otherwise seeded sampling "
        "(request i, seed i). Speedup = tokens/s over plain decoding's in the same run. Accepted length = "
        "1 + accepted / verify steps per request, averaged weighted by output tokens (plain: 1); tokens/forward "
        "= output tokens / (output tokens - accepted), which counts the adaptive policy's plain steps too.",
        "",
    ]
    for m, why in r.get("skipped", {}).items():
        lines.append(f"- `{m}` not measured: {why}")
    if r.get("skipped"):
        lines.append("")
    if r.get("heads"):
        lines += [f"- `{m}` head: `{h}`" for m, h in r["heads"].items()] + [""]
    lines += [
        "| temperature | concurrency | requests | method | tokens/s | speedup vs plain | accepted length | "
        "tokens/forward | acceptance | same tokens as plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lv in r["levels"]:
        for m, x in lv["methods"].items():
            lines.append(
                f"| {lv['temperature']:g} | {lv['concurrency']} | {lv['requests']} | {m} | {x['tokens_per_s']:.1f} | "
                f"**{x['speedup_vs_plain']:.2f}x** | {x['mean_accepted_length']:.2f} | "
                f"{x['tokens_per_target_forward']:.2f} | {x['acceptance_rate']:.3f} | {x['same_tokens_as_plain']} |"
            )
    kind_rows = [lv for lv in r["levels"] if lv["concurrency"] == 1]
    if kind_rows:
        kinds = sorted({k for lv in kind_rows for x in lv["methods"].values() for k in x.get("by_kind", {})})
        lines += [
            "",
            "Mean accepted length per prompt kind, concurrency 1:",
            "",
            "| temperature | method | " + " | ".join(kinds) + " |",
            "| --- | --- | " + " | ".join("---" for _ in kinds) + " |",
        ]
        for lv in kind_rows:
            for m, x in lv["methods"].items():
                bk = x.get("by_kind", {})
                cells = [f"{bk[k]['mean_accepted_length']:.2f}" if k in bk else "" for k in kinds]
                lines.append(f"| {lv['temperature']:g} | {m} | " + " | ".join(cells) + " |")
    if r.get("plot"):
        lines += ["", f"![speedup against concurrency]({r['plot']})"]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> Path:
    """Speedup over plain decoding against concurrency, one line per method and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "bench_heads"  # stable ids: the file changes only with the figures
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    temps = sorted({lv["temperature"] for lv in r["levels"]})
    colors = dict(zip(METHODS, ("grey", "tab:green", "tab:purple", "tab:orange", "tab:blue"), strict=True))
    methods = [m for m in METHODS[1:] if any(m in lv["methods"] for lv in r["levels"])]
    ax.axhline(1.0, color=colors["plain"], linewidth=1, label="plain decoding (reference)")
    styles = ["-", "--", ":", "-."]
    levels = sorted({lv["concurrency"] for lv in r["levels"]})
    for ti, temp in enumerate(temps):
        for m in methods:
            pts = sorted(
                (lv["concurrency"], lv["methods"][m]["speedup_vs_plain"])
                for lv in r["levels"]
                if lv["temperature"] == temp and m in lv["methods"]
            )
            if not pts:
                continue
            ax.plot(
                [c for c, _ in pts],
                [s for _, s in pts],
                marker="o",
                linestyle=styles[ti % len(styles)],
                color=colors[m],
                label=f"{m}, T={temp:g}",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s over plain decoding")
    ax.set_title(f"Speculation methods against concurrency ({r['model_slug']}, {_weights(r)}, CPU)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.text(0.01, 0.01, f"bench/bench_heads.py, {r['date']}, {r['machine']}", fontsize=6, alpha=0.7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path


def publish(r: dict, results: Path, doc: Path | None, img: Path) -> None:
    """Write the results, the plot and the docs section."""
    r["plot"] = str(Path("img") / img.name) if doc is None else str(img)
    print(plot(r, img), flush=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(r, indent=1) + "\n")
    print(results, flush=True)
    write_section(f"heads-{r['model_slug']}", render(r), doc)
    print(doc or "docs/benchmarks.md", flush=True)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help=MODEL_HELP)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--k", type=int, default=None, help="most tokens drafted per step (default: the engine's, 5)")
    ap.add_argument("--fixed-k", action="store_true", help="always draft exactly k (the adaptive policy off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["auto", "none", "fp16", "int8", "int4"],
        help="the engines' weights on CPU (default: the engine's, auto)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per level; each method keeps its fastest")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke: 2 prompts, concurrency 1 and 2, 8 tokens, 1 repeat; writes to a temp folder",
    )
    ap.add_argument("--replot", action="store_true", help="run nothing: section and plot from the saved results")
    # testing the script without trained heads: heads from another folder ({eagle,medusa}/), random ones on request
    ap.add_argument("--head-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--random-heads", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    slug = model_slug(args.model) + (f"-{args.quantization}" if args.quantization else "")
    results = ROOT / "bench" / "results" / f"heads_{slug}.json"
    img = ROOT / "docs" / "img" / f"heads_speedup_{slug}.svg"
    if args.replot:
        publish(json.loads(results.read_text()), results, None, img)
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "plain" not in methods:
        ap.error(f"--methods: of {', '.join(METHODS)}, plain included (the reference); got {args.methods}")
    methods = ["plain"] + [m for m in methods if m != "plain"]
    levels, temps = _ints(args.concurrency), [float(t) for t in args.temperatures.split(",") if t]
    prompts_src, repeats = ALL, args.repeats
    if args.quick:
        prompts_src, levels, args.max_tokens, repeats = [ALL[0], ALL[8]], [1, 2], 8, 1
    if args.random_heads and args.head_dir is None:
        ap.error("--random-heads needs --head-dir")
    doc = None
    if args.quick or args.random_heads:  # never into the docs: a smoke run or untrained heads
        tmp = Path(tempfile.mkdtemp(prefix="bench_heads_"))
        results, img, doc = tmp / results.name, tmp / img.name, tmp / "benchmarks.md"
    if args.random_heads:
        make_random_heads(args.model, args.head_dir)
    torch.set_num_threads(args.threads)
    configure_logging("console", "warning")

    max_len = PROMPT_ROOM + args.max_tokens + 16  # the prompts are far shorter; 16: room for drafts
    llms, skipped = build_engines(args, methods, max_len, max(levels))
    missing = [m for m in skipped if m != "draft"]
    if missing and not args.quick:  # a real run without the heads it is for: refuse before the hours of measuring
        raise SystemExit(f"cannot build {', '.join(missing)} (above): train the heads, or leave them out of --methods")
    prompts, fmt = encode_prompts(llms["plain"], prompts_src)
    if max(len(p["ids"]) for p in prompts) > PROMPT_ROOM:
        raise SystemExit(f"a prompt is longer than {PROMPT_ROOM} tokens: raise PROMPT_ROOM")
    heads = {}
    for m in ("eagle", "medusa"):
        llm = llms.get(m)
        head = getattr(llm.engine.spec.proposer, "head", None) if llm is not None and llm.engine.spec else None
        if head is not None:
            heads[m] = str(head.folder.relative_to(ROOT) if head.folder.is_relative_to(ROOT) else head.folder)
            print(f"{m}: head {heads[m]} (trained for {head.config.target!r})", flush=True)
    for llm in llms.values():  # warm-up
        closed_loop(llm, [(0, prompts[0])], request_params([(0, prompts[0])], 0, 8), 1)
    r: dict = {
        "command": "python " + shlex.join(["bench/bench_heads.py", *sys.argv[1:]]),
        "model": args.model,
        "model_slug": slug,
        "quantization": args.quantization,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "num_prompts": len(prompts),
        "kinds": list(dict.fromkeys(p["kind"] for p in prompts)),
        "prompt_format": fmt,
        "chat_template": not fmt.startswith("given as plain text"),
        "max_tokens": args.max_tokens,
        "k": args.k,
        "fixed_k": args.fixed_k,
        "repeats": repeats,
        "skipped": skipped,
        "heads": heads,
        "levels": [],
    }
    for temp in temps:
        for c in levels:
            r["levels"].append(bench_level(llms, prompts, c, temp, args.max_tokens, repeats))
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps(r, indent=1) + "\n")  # each level as soon as it exists
    publish(r, results, doc, img)
    if doc is not None:
        print(render(r))


if __name__ == "__main__":
    main()
