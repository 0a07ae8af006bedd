"""The ``draftwise`` command.

draftwise generate "def fibonacci(n):"     # greedy, in-process, embedded default model
"""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from draftwise.worker import default_model_path
    from draftwise.worker.greedy import greedy_tokens
    from draftwise.worker.loader import load_model
    from draftwise.worker.model_config import ModelLoadError
    from draftwise.worker.tokenizer import load_tokenizer

    folder = args.model or default_model_path("target")
    try:
        loaded = load_model(folder, dtype=args.dtype, device=args.device)
        tok = load_tokenizer(folder)
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = tok.encode(args.prompt)
    stop = () if args.ignore_eos else loaded.config.eos_token_ids
    out: list[int] = []
    shown = ""
    sys.stdout.write(args.prompt)
    for t in greedy_tokens(loaded, ids, args.max_tokens, stop_ids=stop):
        if t in stop:
            break
        out.append(t)
        text = tok.decode(out)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
            continue
        sys.stdout.write(text[len(shown) :])
        sys.stdout.flush()
        shown = text
    sys.stdout.write(tok.decode(out)[len(shown) :] + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftwise", description="draftwise: LLM serving with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete a prompt greedily, in-process")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the embedded model)")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (default)")
    g.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    args = parser.parse_args(argv)
    if args.command == "generate":
        if args.max_tokens < 1:
            parser.error("--max-tokens must be >= 1")
        return _generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
