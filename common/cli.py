"""The ``draftwise`` command.

draftwise serve [--workers 2] [--port 50051] [--model FOLDER|FILE.gguf]   # gateway + workers on this machine
draftwise serve --speculative-model default                     # ... with speculative decoding
draftwise generate "def fibonacci(n):"                           # greedy, in-process, embedded default model
draftwise generate "def fibonacci(n):" --server 127.0.0.1:50051  # streamed from a running server
draftwise chat --server 127.0.0.1:50051                          # a conversation (a model with a chat template)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

API_KEY_ENV = "DRAFTWISE_API_KEY"
"""Environment variable holding the API key ``generate --server`` sends (unless --api-key)."""

ENGINE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--model", str, "Hugging Face checkpoint folder or .gguf file (default: the embedded model)"),
    ("--model-name", str, "name clients use for it (default: draftwise-target, or the folder's name)"),
    ("--dtype", str, "float32 | bfloat16 | float16 | auto"),
    ("--device", str, "cpu | cuda | cuda:N"),
    ("--max-model-len", int, "context length (default: the model's)"),
    ("--max-num-seqs", int, "requests in one engine step"),
    ("--max-num-batched-tokens", int, "tokens in one engine step"),
    ("--block-size", int, "tokens per KV block"),
    ("--num-kv-blocks", int, "exact KV block count per worker"),
    ("--kv-cache-memory-bytes", int, "KV budget in bytes per worker"),
    ("--gpu-memory-utilization", float, "CUDA: share of device memory per worker"),
    (
        "--speculative-model",
        str,
        "speculative decoding with this draft checkpoint folder or .gguf file, or 'default' (the embedded draft)",
    ),
    ("--speculative-method", str, "draft | ngram (default: draft when --speculative-model is given)"),
    ("--num-speculative-tokens", int, "most tokens drafted per request per step (default 5)"),
    ("--prompt-lookup-min", int, "ngram: shortest suffix matched in the prompt and output (default 1)"),
    ("--prompt-lookup-max", int, "ngram: longest suffix tried first (default 4)"),
)
"""Worker flags ``draftwise serve`` accepts and passes on (only those given)."""


def _generate(args: argparse.Namespace) -> int:
    from draftwise.worker import default_model_path
    from draftwise.worker.engine.config import EngineConfig, as_flags
    from draftwise.worker.model.greedy import greedy_tokens
    from draftwise.worker.model.loader import load_model
    from draftwise.worker.model.model_config import ModelLoadError
    from draftwise.worker.text.tokenizer import load_tokenizer

    folder = args.model or default_model_path("target")
    try:
        EngineConfig(dtype=args.dtype, device=args.device)  # checks both before anything loads
        loaded = load_model(folder, dtype=args.dtype, device=args.device)
        tok = load_tokenizer(folder)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a bad --dtype or --device
        print(f"error: {as_flags(str(e))}", file=sys.stderr)
        return 2
    ids = tok.encode(args.prompt)
    context = loaded.config.max_position_embeddings
    if not ids:
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    if len(ids) + args.max_tokens > context:
        print(
            f"error: the prompt is {len(ids)} tokens and --max-tokens is {args.max_tokens}: together more than the "
            f"model's context of {context} tokens (shorten the prompt or lower --max-tokens)",
            file=sys.stderr,
        )
        return 2
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


def _wait_serving(channel: object, timeout: float, metadata: list[tuple[str, str]]) -> str | None:
    """Poll the server's health until SERVING; None then, else why not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0, metadata=metadata).status  # pyright: ignore[reportAttributeAccessIssue]
            if status == health_pb2.HealthCheckResponse.SERVING:
                return None
            last = f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        except grpc.RpcError as e:
            last = f"{e.code().name}: {e.details()}"
        if time.monotonic() >= deadline:
            return last
        time.sleep(0.25)


RESUME_ATTEMPTS = 5
"""Reconnections in a row (without a new delta) ``generate --server`` makes after its
connection dropped mid-stream, before it reports the error."""
RESUME_BACKOFF_S = (0.05, 2.0)
"""First and longest delay between those reconnections (doubling)."""
TRANSPORT_DETAILS = ("Internal error from Core", "Stream removed", "Socket closed", "Connection reset")
"""Details of a call the transport tore down (INTERNAL or UNKNOWN rather than UNAVAILABLE)."""


def _transport_error(e: object) -> bool:
    """Whether a failed call's status says the connection broke (not the server's verdict)."""
    import grpc

    code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and any(d in details for d in TRANSPORT_DETAILS)


def _tls_hint(problem: str, tls: bool) -> str:
    """A hint for a connection that failed the way a TLS mismatch fails: a plaintext client
    against a TLS server sees its socket closed; a TLS client against a plaintext server (or
    with the wrong CA) fails the handshake."""
    low = problem.lower()
    if not tls and ("socket closed" in low or "connection reset" in low):
        return " (if the server uses TLS, add --tls, or --tls-ca CA.pem for a private CA)"
    if tls and any(w in low for w in ("ssl", "handshake", "certificate", "tls")):
        return (
            " (the TLS handshake failed: the server may not use TLS (drop --tls/--tls-ca), or --tls-ca is not its CA)"
        )
    return ""


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream the completion from a running server. Should the connection drop after the
    first delta, reconnect and resume the request with its resume handle at the first token
    not yet printed (the gateway fails the request over should its worker die): the text
    goes on without a break, nothing repeated. Same contract as the Python client's
    ResumePolicy (``draftwise_client``), which the wheel does not carry."""
    import grpc

    from draftwise.v1 import generate_service_pb2 as gspb
    from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
    from draftwise.v1 import generation_pb2 as pb

    if args.tls_ca or args.tls:
        try:
            roots = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        except OSError as e:
            print(f"error: --tls-ca {args.tls_ca}: {e.strerror or e}", file=sys.stderr)
            return 2
        channel = grpc.secure_channel(args.server, grpc.ssl_channel_credentials(root_certificates=roots))
    else:
        channel = grpc.insecure_channel(args.server)
    key = args.api_key or os.environ.get(API_KEY_ENV)
    metadata = [("authorization", f"Bearer {key}")] if key else []
    with channel:
        if args.wait:
            problem = _wait_serving(channel, args.wait, metadata)
            if problem is not None:
                hint = _tls_hint(problem, bool(args.tls or args.tls_ca))
                print(f"error: {args.server} is not serving after {args.wait:g} s ({problem}){hint}", file=sys.stderr)
                return 1
        params = pb.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        start = pb.StartGeneration(model=args.model or "", prompt=pb.Prompt(text=args.prompt), sampling_params=params)
        stub = gsgrpc.GenerateServiceStub(channel)
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        handle, next_index, in_row = "", 0, 0
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
        while True:
            if handle:
                req = gspb.GenerateStreamRequest(
                    resume=gspb.ResumeGeneration(resume_handle=handle, next_token_index=next_index)
                )
            else:
                req = gspb.GenerateStreamRequest(start=start)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = stub.GenerateStream(req, metadata=metadata, timeout=remaining)
            try:
                for resp in call:
                    if resp.event.WhichOneof("kind") != "delta":
                        continue
                    d = resp.event.delta
                    handle = handle or d.resume_handle
                    if d.first_token_index + len(d.token_ids) <= next_index and d.token_ids:
                        continue  # replayed after a resume: already printed
                    if d.first_token_index != next_index:
                        sys.stdout.write("\n")
                        print(
                            f"error: the stream skipped from token {next_index} to {d.first_token_index}",
                            file=sys.stderr,
                        )
                        return 1
                    next_index += len(d.token_ids)
                    in_row = 0
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
                break
            except grpc.RpcError as e:
                in_row += 1
                delay = min(RESUME_BACKOFF_S[1], RESUME_BACKOFF_S[0] * 2 ** (in_row - 1))
                late = deadline is not None and time.monotonic() + delay >= deadline
                if not handle or not _transport_error(e) or in_row > RESUME_ATTEMPTS or late:
                    sys.stdout.write("\n")
                    hint = _tls_hint(e.details() or "", bool(args.tls or args.tls_ca))
                    print(f"error: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
                    return 1
            finally:
                call.cancel()
            time.sleep(delay)
        sys.stdout.write("\n")
    return 0


def _engine_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the engine flags, named as flags, checked before any worker starts
    (a worker takes seconds to load); None when they make a valid engine configuration. Only
    the worker's configuration module is read here, which imports neither torch nor the rest
    of the worker."""
    from draftwise.worker.engine.config import EngineConfig, as_flags, missing_paths

    given = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _t, _h in ENGINE_FLAGS}
    given = {k: v for k, v in given.items() if v is not None and k != "model_name"}
    if args.speculative_adaptive is not None:
        given["speculative_adaptive"] = args.speculative_adaptive
    try:
        cfg = EngineConfig(**given)
    except ValueError as e:
        return as_flags(str(e))
    for name, path in missing_paths(cfg):
        return f"--{name.replace('_', '-')} {path}: no such file or folder"
    return None


def _serve(args: argparse.Namespace) -> int:
    from draftwise.gateway.launcher import ServeConfig, serve
    from draftwise.gateway.main import config_from_args, run_loop
    from draftwise.hop import CLIENT_KEY_ENV_VARS
    from draftwise.logs import configure_logging

    worker_args: list[str] = []
    for flag, _type, _help in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            worker_args += [flag, str(value)]
    if args.enforce_eager:
        worker_args.append("--enforce-eager")
    if args.speculative_adaptive is not None:
        worker_args.append("--speculative-adaptive" if args.speculative_adaptive else "--no-speculative-adaptive")
    problem = _engine_flags_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        configure_logging(args.log_format, args.log_level)
        cfg = ServeConfig(
            num_workers=args.workers,
            worker_args=tuple(worker_args),
            threads_per_worker=args.threads_per_worker,
            startup_timeout_s=args.startup_timeout,
            log_format=args.log_format,
            log_level=args.log_level,
            internal_secret_file=args.internal_secret_file,
            # client keys stay with the gateway: the workers never see them
            scrub_env=tuple(k for k in dict.fromkeys((*CLIENT_KEY_ENV_VARS, args.api_keys_env)) if k),
            gateway=config_from_args(args, ()),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run_loop(lambda: serve(cfg))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


DEFAULT_SERVER_PORT = 50051
"""The port ``--server HOST`` dials when it names none (the gateway's default)."""


def server_address(text: str) -> str:
    """``--server``'s target: HOST[:PORT], or [IPv6][:PORT]; without a port, the gateway's default."""
    if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address: its colons are its own
        return f"[{text}]:{DEFAULT_SERVER_PORT}"
    host, sep, port = text.rpartition(":")
    if text.endswith("]") or not sep:
        return f"{text}:{DEFAULT_SERVER_PORT}"  # no port given
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return text


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("draftwise")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


SELF_PARSING = {
    "worker": ("draftwise.worker.serving.server", "run one worker (an engine behind WorkerService): one container"),
    "gateway": ("draftwise.gateway.main", "run the gateway alone, in front of --worker / --worker-dns: one container"),
}
"""Subcommands that parse their own flags (see ``draftwise worker --help``): {name: (module, help)}."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SELF_PARSING:  # their own parsers: `gateway` never imports torch
        import importlib

        module = importlib.import_module(SELF_PARSING[argv[0]][0])
        return module.main(argv[1:], prog=f"draftwise {argv[0]}")
    parser = argparse.ArgumentParser(prog="draftwise", description="draftwise: LLM serving with speculative decoding")
    parser.add_argument("--version", action="version", version=f"draftwise {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt: greedily in-process, or streamed from --server")
    g.add_argument("prompt")
    g.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or .gguf file (in-process; default: the embedded model) or model name (--server)",
    )
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (default; in-process)")
    g.add_argument("--device", default="cpu", help="cpu | cuda (default cpu; in-process)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument(
        "--server",
        type=server_address,
        default=None,
        help=f"HOST[:PORT] of a running `draftwise serve` (gateway) to stream from (port default {DEFAULT_SERVER_PORT})",
    )
    g.add_argument(
        "--wait", type=float, default=0.0, help="with --server: wait up to this many seconds for it to serve"
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="with --server: sampling temperature (default 0: greedy)"
    )
    g.add_argument("--timeout", type=float, default=None, help="with --server: deadline of the request in seconds")
    g.add_argument("--api-key", default=None, help=f"with --server: API key (default: ${API_KEY_ENV})")
    g.add_argument("--tls", action="store_true", help="with --server: connect over TLS (system roots)")
    g.add_argument("--tls-ca", default=None, help="with --server: connect over TLS trusting this PEM root certificate")

    from draftwise.chat_cli import add_chat_args

    c = sub.add_parser("chat", help="a conversation with a served model (its chat template), streamed from --server")
    add_chat_args(c, server_address, DEFAULT_SERVER_PORT, API_KEY_ENV)

    s = sub.add_parser("serve", help="start a gateway and worker processes on this machine")
    s.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    for flag, type_, help_ in ENGINE_FLAGS:
        s.add_argument(flag, type=type_, default=None, help=help_)
    s.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    s.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the speculation policy pick k <= --num-speculative-tokens per request and step "
        "(default); --no-speculative-adaptive: always draft exactly that many",
    )
    s.add_argument(
        "--threads-per-worker", type=int, default=None, help="CPU threads per worker (default: cores shared)"
    )
    s.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the workers may take to start")
    from draftwise.envflags import apply_env
    from draftwise.gateway.main import add_gateway_args
    from draftwise.health_cli import add_health_args

    add_gateway_args(s)
    apply_env(s)
    for name, (_module, help_) in SELF_PARSING.items():
        sub.add_parser(name, help=help_, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    h = sub.add_parser("health", help="exit 0 when a gateway or worker answers grpc.health.v1 SERVING, else 1")
    add_health_args(h)

    args = parser.parse_args(argv)
    if args.command == "health":
        from draftwise.health_cli import run

        return run(args)
    if args.command == "generate":
        if args.max_tokens < 1:
            parser.error("--max-tokens must be >= 1")
        from draftwise.logs import configure_logging

        configure_logging("auto", "warning")  # stdout carries the text alone
        if args.server:
            return _generate_remote(args)
        return _generate(args)
    if args.command == "chat":
        from draftwise.chat_cli import run_chat
        from draftwise.logs import configure_logging

        configure_logging("auto", "warning")  # stdout carries the replies alone
        return run_chat(args, API_KEY_ENV)
    if args.command == "serve":
        if args.workers < 1:
            parser.error("--workers must be >= 1")
        return _serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
