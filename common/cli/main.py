"""The ``draftwise`` command's top level: its subcommands and their dispatch. Each subcommand
lives in a module of its own; importing this one imports neither torch nor the worker."""

from __future__ import annotations

import argparse
import importlib
import sys

SELF_PARSING = {
    "worker": ("draftwise.worker.serving.server", "run one worker (an engine behind WorkerService): one container"),
    "gateway": ("draftwise.gateway.main", "run the gateway alone, in front of --worker / --worker-dns: one container"),
}
"""Subcommands that parse their own flags (see ``draftwise worker --help``): {name: (module, help)}."""


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("draftwise")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from draftwise.cli.chat import add_chat_args
    from draftwise.cli.generate import add_generate_args
    from draftwise.cli.serve import add_serve_args
    from draftwise.health_cli import add_health_args

    parser = argparse.ArgumentParser(prog="draftwise", description="draftwise: LLM serving with speculative decoding")
    parser.add_argument("--version", action="version", version=f"draftwise {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(
        sub.add_parser("generate", help="complete a prompt: in-process with the engine, or streamed from --server")
    )
    add_chat_args(
        sub.add_parser("chat", help="a conversation with a served model (its chat template), streamed from --server")
    )
    add_serve_args(sub.add_parser("serve", help="start a gateway and worker processes on this machine"))
    for name, (_module, help_) in SELF_PARSING.items():
        sub.add_parser(name, help=help_, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    add_health_args(
        sub.add_parser("health", help="exit 0 when a gateway or worker answers grpc.health.v1 SERVING, else 1")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SELF_PARSING:  # their own parsers: `gateway` never imports torch
        module = importlib.import_module(SELF_PARSING[argv[0]][0])
        return module.main(argv[1:], prog=f"draftwise {argv[0]}")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "health":
        from draftwise.health_cli import run

        return run(args)
    if args.command in ("generate", "chat"):
        from draftwise.logs import configure_logging

        if args.command == "generate" and args.max_tokens < 1:
            parser.error("--max-tokens must be >= 1")
        configure_logging("auto", "warning")  # stdout carries the text alone
        if args.command == "generate":
            from draftwise.cli.generate import run_generate

            return run_generate(args)
        from draftwise.cli.chat import run_chat

        return run_chat(args)
    if args.command == "serve":
        if args.num_workers < 1:
            parser.error("--workers must be >= 1")
        from draftwise.cli.serve import run_serve

        return run_serve(args)
    return 2
