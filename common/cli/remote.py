"""``draftwise generate PROMPT --server HOST:PORT``: stream the completion from a running
gateway through the Python client (``draftwise_client.Client``).

The client carries the recovery policy: a request the server turns away before its first token
(RESOURCE_EXHAUSTED, UNAVAILABLE) is sent again with backoff (``RetryPolicy``); a connection that
drops after it is resumed with the request's resume handle at the first token not yet printed
(``ResumePolicy``; the gateway fails the request over should its worker die), so the text goes on
without a break and nothing is repeated. This module adds what a terminal wants: ``--wait`` for
the server to come up, one ``error:`` line with a hint when TLS does not match, Ctrl-C, and
``--stats`` (:mod:`draftwise.cli.stats`): the request's counters from its deltas and final usage.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from types import ModuleType

from draftwise.cli.connect import (
    api_key,
    metadata,
    not_serving,
    open_channel,
    tls_ca_problem,
    tls_hint,
    tls_roots,
    uses_tls,
    wait_serving,
)
from draftwise.cli.stats import print_stats, spec_counts

CLIENT_PACKAGE = "draftwise_client"
"""The Python client's import name (the ``draftwise-client`` distribution, ``clients/python``)."""


def load_client() -> ModuleType | None:
    """The Python client package (installed beside this one: ``pip install ./clients/python``), or
    None when it is not installed."""
    try:
        return importlib.import_module(CLIENT_PACKAGE)
    except ImportError:
        return None


def generate_remote(args: argparse.Namespace) -> int:
    try:
        roots = tls_roots(args)
    except OSError as e:
        print(f"error: {tls_ca_problem(args, e)}", file=sys.stderr)
        return 2
    dc = load_client()
    if dc is None:
        print(
            "error: generate --server needs the Python client (the draftwise-client package): "
            "pip install ./clients/python from the draftwise repository",
            file=sys.stderr,
        )
        return 2
    try:
        return _stream(dc, args, roots)
    except KeyboardInterrupt:  # Ctrl-C: the request is cancelled on the way out; what was printed stays
        sys.stdout.write("\n")
        return 130


def _stream(dc: ModuleType, args: argparse.Namespace, roots: bytes | None) -> int:
    if args.wait:
        with open_channel(args, roots) as channel:
            problem = wait_serving(channel, args.wait, metadata(args))
        if problem is not None:
            print(f"error: {not_serving(args, problem)}", file=sys.stderr)
            return 1
    params = dc.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    with dc.Client(args.server, api_key=api_key(args), tls=bool(args.tls), root_certificates=roots) as client:
        stream = client.generate(args.prompt, params, model=args.model or "", timeout=args.timeout)
        last_spec = usage = None
        try:
            with contextlib.closing(stream):  # leaving early (Ctrl-C) cancels the request on the server
                for delta in stream:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    last_spec = delta.speculation or last_spec
                    usage = delta.usage or usage
        except dc.GenerationError as e:
            sys.stdout.write("\n")
            print(f"error: {e.code.name}: {e.message}{tls_hint(e.message, uses_tls(args))}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats and usage is not None:
        spec = spec_counts(usage.speculative_proposed_tokens, usage.speculative_accepted_tokens, last_spec)
        print_stats(usage.completion_tokens, spec)
    return 0
