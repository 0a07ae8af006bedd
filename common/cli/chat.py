"""``draftwise chat --server HOST:PORT``: a conversation with a served model in the terminal.

Each line you type is a user message; the reply streams back as the model writes it, and
the conversation so far (``--system`` first) goes with every turn, rendered by the server
with the model's chat template. Ctrl-D or Ctrl-C ends it (exit 0). When standard input is
not a terminal, every line read is one user turn and the replies are printed one after
the other (no prompt), so a script can pipe a conversation through it. ``--stats`` prints,
after each reply, its token count and speculation counters on stderr (:mod:`draftwise.cli.stats`).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from draftwise.cli.connect import (
    add_connection_args,
    metadata,
    not_serving,
    open_channel,
    tls_ca_problem,
    tls_hint,
    tls_roots,
    uses_tls,
    wait_serving,
)
from draftwise.cli.stats import STATS_HELP, SpecCounts, print_stats, spec_counts

PROMPT = ">>> "
"""What an interactive session shows before each user turn."""


def add_chat_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--model", default="", help="model name (default: the server's default model)")
    c.add_argument("--system", default=None, help="a system message that opens the conversation")
    c.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default 256)")
    c.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    c.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default 1)")
    c.add_argument("--seed", type=int, default=None, help="seed of the replies' random numbers (default: random)")
    c.add_argument("--stats", action="store_true", help=STATS_HELP)
    add_connection_args(c, required=True)


_CAN_MASK = hasattr(signal, "pthread_sigmask")


@contextlib.contextmanager
def sigint_to_this_thread_only() -> Iterator[None]:
    """Block SIGINT in this (the main) thread while the block runs, so that every thread
    started meanwhile, gRPC's included, inherits a mask that blocks it; restore the mask after.

    A terminal's Ctrl-C sends SIGINT to the process, and the kernel gives it to any thread
    that does not block it. Python runs signal handlers only in the main thread: when a gRPC
    thread took it, the main thread, asleep in the prompt's select(), never woke and Ctrl-C
    did nothing until the next key. With every other thread blocking SIGINT, the kernel gives
    it to the main thread, at the moments it unblocks it (:func:`sigint_allowed`)."""
    if not _CAN_MASK:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C pending once the session is over: it is over
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def sigint_allowed() -> Iterator[None]:
    """Let SIGINT in (to this thread) while the block runs: at the prompt and while a reply
    streams. A Ctrl-C that came while it was blocked is raised on entry."""
    if not _CAN_MASK:
        yield
        return
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending SIGINT raises KeyboardInterrupt here
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


class Chat:
    """One conversation over one channel."""

    def __init__(self, args: argparse.Namespace, channel: Any, metadata: list[tuple[str, str]]) -> None:
        from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
        from draftwise.v1 import generation_pb2 as pb

        self.args = args
        self.pb = pb
        self.stub = gsgrpc.GenerateServiceStub(channel)
        self.metadata = metadata
        self.history: list[tuple[str, str]] = []
        self.stats: tuple[int, SpecCounts | None] | None = None
        """The last reply's token count and speculation counters (None until a reply finished)."""
        if args.system:
            self.history.append(("system", args.system))
        self.params = pb.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        if args.top_p is not None:
            self.params.top_p = args.top_p
        if args.seed is not None:
            self.params.seed = args.seed

    def turn(self, text: str, out: TextIO) -> str:
        """Send ``text`` as the next user message and stream the reply to ``out``; the reply
        (kept in the history). grpc.RpcError when the server refuses or fails it (the user
        message is then not kept)."""
        from draftwise.v1 import generate_service_pb2 as gspb

        pb = self.pb
        messages = [*self.history, ("user", text)]
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])
        start = pb.StartGeneration(model=self.args.model, prompt=pb.Prompt(chat=chat), sampling_params=self.params)
        call = self.stub.GenerateStream(  # may start gRPC threads: under run_chat they inherit SIGINT blocked
            gspb.GenerateStreamRequest(start=start), metadata=self.metadata, timeout=self.args.timeout
        )
        reply: list[str] = []
        self.stats = None
        last_spec = None  # the latest SpeculationStats a delta carried
        try:
            with sigint_allowed():  # Ctrl-C cancels the reply in progress
                for resp in call:
                    kind = resp.event.WhichOneof("kind")
                    if kind == "delta":
                        reply.append(resp.event.delta.text)
                        out.write(resp.event.delta.text)
                        out.flush()
                        if resp.event.delta.HasField("speculation"):
                            last_spec = resp.event.delta.speculation
                    elif kind == "finished":
                        u = resp.event.finished.usage
                        spec = spec_counts(u.speculative_proposed_tokens, u.speculative_accepted_tokens, last_spec)
                        self.stats = (u.completion_tokens, spec)
        finally:
            call.cancel()  # Ctrl-C mid-reply: the server stops generating
        answer = "".join(reply)
        self.history = [*messages, ("assistant", answer)]
        return answer


def _loop(chat: Chat, interactive: bool, stdin: TextIO, out: TextIO) -> int:
    import grpc

    while True:
        if interactive:
            try:
                with sigint_allowed():
                    text = input(PROMPT)  # line editing (readline)
            except EOFError:  # Ctrl-D
                out.write("\n")
                return 0
        else:
            with sigint_allowed():
                line = stdin.readline()
            if not line:  # end of input
                return 0
            text = line.rstrip("\n")
        if not text.strip():
            continue
        try:
            chat.turn(text, out)
        except grpc.RpcError as e:
            out.write("\n")
            out.flush()
            hint = tls_hint(e.details() or "", uses_tls(chat.args))
            print(f"error: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            if not interactive:
                return 1
            continue
        out.write("\n")
        out.flush()
        if chat.args.stats and chat.stats is not None:
            print_stats(*chat.stats)


def run_chat(args: argparse.Namespace) -> int:
    """The ``chat`` command: 0 when the conversation ends (Ctrl-D, Ctrl-C, end of input)."""
    if args.max_tokens < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    with sigint_to_this_thread_only():  # before gRPC starts any thread: they all inherit SIGINT blocked
        return _run_chat(args)


def _run_chat(args: argparse.Namespace) -> int:
    try:
        channel = open_channel(args, tls_roots(args))
    except OSError as e:
        print(f"error: {tls_ca_problem(args, e)}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    try:
        with channel:
            if args.wait:
                with sigint_allowed():  # Ctrl-C ends the wait for the server at once
                    problem = wait_serving(channel, args.wait, metadata(args))
                if problem is not None:
                    print(f"error: {not_serving(args, problem)}", file=sys.stderr)
                    return 1
            if interactive:
                import readline  # noqa: F401  (line editing and history for input lines)

                print(f"chatting with {args.server} (Ctrl-D or Ctrl-C to quit)", file=sys.stderr)
            return _loop(Chat(args, channel, metadata(args)), interactive, sys.stdin, sys.stdout)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 0  # the reply in progress, if any, was cancelled on the way out
