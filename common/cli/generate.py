"""``draftwise generate PROMPT``: complete one prompt and stream the text as it is produced.

In-process (no ``--server``) it runs the engine itself (``LLMEngine``, the one every worker
runs): greedy by default, stopping where the engine stops (the model's end-of-sequence ids:
config.json, generation_config.json and the tokenizer's), the text coming out of the engine's
incremental detokenizer. Every engine flag of ``draftwise serve`` applies (``--speculative-model
default``, ``--device cuda``, ...). With ``--server`` it streams from a running gateway through
the Python client (:mod:`draftwise.cli.remote`). ``--stats`` prints, after the text, its
token count and speculation counters on stderr (:mod:`draftwise.cli.stats`).
"""

from __future__ import annotations

import argparse
import sys

from draftwise.cli.connect import add_connection_args
from draftwise.cli.stats import STATS_HELP, SpecCounts, print_stats
from draftwise.flagtable import add_flags

REQUEST_ID = "generate"


def add_generate_args(g: argparse.ArgumentParser) -> None:
    from draftwise.cli.engine_flags import GENERATE_DEFAULTS, GENERATE_SKIP, engine_flags

    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--stats", action="store_true", help=STATS_HELP)
    add_connection_args(g, required=False, note="with --server: ")
    flags = engine_flags()
    (model,) = [f for f in flags if f.name == "model"]
    engine = g.add_argument_group("engine (in-process; with --server only --model applies, as the model's name)")
    add_flags(
        engine,
        flags,
        defaults=GENERATE_DEFAULTS,
        skip=GENERATE_SKIP,
        helps={"model": f"{model.help}; with --server: the served model's name"},
    )


def local_only_flags(args: argparse.Namespace) -> list[str]:
    """Engine flags given (their value is not generate's default) that only an in-process run
    reads: all but ``--model``."""
    from draftwise.cli.engine_flags import GENERATE_DEFAULTS, GENERATE_SKIP, engine_flags

    out = []
    for flag in engine_flags():
        if flag.name in GENERATE_SKIP or flag.name == "model":
            continue
        if getattr(args, flag.name) != GENERATE_DEFAULTS.get(flag.name, flag.default):
            out.append(flag.option)
    return out


def run_generate(args: argparse.Namespace) -> int:
    if args.server:
        given = local_only_flags(args)
        if given:
            print(f"error: {', '.join(given)}: engine flags of an in-process run, not with --server", file=sys.stderr)
            return 2
        from draftwise.cli.remote import generate_remote

        return generate_remote(args)
    return _generate_local(args)


def _generate_local(args: argparse.Namespace) -> int:
    from draftwise.cli.engine_flags import GENERATE_SKIP, alias_problem, engine_config, hub_problem, with_local_copies
    from draftwise.worker.sampling.sampling_params import SamplingParams

    try:
        config = engine_config(args, skip=GENERATE_SKIP)  # checks the flags before anything loads
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # a model alias whose package is not installed, a Hugging Face name with no local copy
    problem = alias_problem(config) or hub_problem(config)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    config = with_local_copies(config)
    from draftwise.worker.core.containment import EngineDeadError
    from draftwise.worker.engine.llm_engine import LLMEngine
    from draftwise.worker.model.model_config import ModelLoadError

    try:
        engine = LLMEngine(config)
        ids = engine.encode_prompt(args.prompt)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # flags that load but do not fit the model (--max-model-len, a KV budget), a bad prompt
        print(f"error: {e}", file=sys.stderr)
        return 2
    context = engine.max_model_len
    if len(ids) + args.max_tokens > context:
        whose = "the model's context" if config.max_model_len is None else "--max-model-len"
        print(
            f"error: the prompt is {len(ids)} tokens and --max-tokens is {args.max_tokens}: together more than "
            f"{whose} of {context} tokens (shorten the prompt or lower --max-tokens)",
            file=sys.stderr,
        )
        return 2
    engine.add_request(REQUEST_ID, args.prompt, params, prompt_token_ids=ids)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    final = None
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step().deltas:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                final = delta.final or final
                if delta.finish_reason == "error":
                    sys.stdout.write("\n")
                    print(f"error: {delta.error}", file=sys.stderr)
                    return 1
    except KeyboardInterrupt:  # Ctrl-C: what was printed stays, on a line of its own
        sys.stdout.write("\n")
        return 130
    except EngineDeadError as e:
        sys.stdout.write("\n")
        print(f"error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats and final is not None:
        out = final.outputs[0]
        spec = None if out.spec is None else SpecCounts(out.spec.proposed, out.spec.accepted, out.spec.verify_steps)
        print_stats(len(out.token_ids), spec)
    return 0
