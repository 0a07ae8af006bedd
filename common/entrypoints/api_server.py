"""``python -m draftwise.entrypoints.api_server``: vLLM's legacy API server command, here.

    python -m draftwise.entrypoints.api_server --model FOLDER --draft-model FOLDER \\
        --num-speculative-tokens 5 --use-v2-block-manager --port 8000

It starts what ``draftwise serve`` starts (:mod:`draftwise.cli.serve`: a gateway and worker
processes, every engine flag checked before a worker starts), with the HTTP endpoint on ``--port``
(vLLM's meaning: the HTTP port, default 8000; the gRPC port is ``--grpc-port``, default any free
one). That endpoint answers vLLM's ``POST /generate`` (``{"prompt": ..., "max_tokens": ...}`` ->
``{"text": [prompt + output]}``, streamed as ``\\0``-separated JSON chunks with ``"stream": true``;
:mod:`draftwise.gateway.openai.legacy_generate`), ``GET /health`` and the OpenAI routes
(docs/openai.md). ``--host`` defaults to 127.0.0.1 (vLLM's listens on every interface: pass
``--host 0.0.0.0`` for that).
"""

from __future__ import annotations

import argparse
import sys

PROG = "python -m draftwise.entrypoints.api_server"


def build_parser() -> argparse.ArgumentParser:
    from draftwise.cli.serve import add_serve_args

    p = argparse.ArgumentParser(
        prog=PROG,
        description="draftwise serve under vLLM's api_server command: POST /generate (and the OpenAI routes) on --port",
        conflict_handler="resolve",  # --port is the HTTP port here (add_serve_args(api_server=True))
    )
    add_serve_args(p, api_server=True)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error("--workers must be >= 1")
    from draftwise.cli.serve import run_serve

    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
