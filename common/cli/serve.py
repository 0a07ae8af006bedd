"""``draftwise serve [MODEL]``: a gateway and worker processes on this machine
(:mod:`draftwise.gateway.launcher`).

Its flags come from three tables (:mod:`draftwise.flagtable`): ServeConfig's (``--workers``,
``--startup-timeout``, ...), EngineConfig's (every engine flag, checked here before any worker
starts and passed on to each worker when it differs from the default) and GatewayConfig's (the
gateway's flags, the same as ``draftwise gateway``'s). The model may also be given as vLLM's
``serve MODEL`` does, positionally. A Hugging Face name (``meta-llama/Meta-Llama-3-8B``) is
served under that name from its local copy (:mod:`draftwise.worker.paths`).

``python -m draftwise.entrypoints.api_server`` is this command with vLLM's ``--port``: the HTTP
port (:func:`add_serve_args` with ``api_server=True``).
"""

from __future__ import annotations

import argparse
import functools
import sys

from draftwise.flagtable import Flag, add_flags, as_argv, changed, config_values, table

SERVE_INTERNAL = {
    "worker_args": "the engine flags (and --model-name), passed on to every worker",
    "log_format": "the gateway's --log-format, which the workers share",
    "log_level": "the gateway's --log-level, which the workers share",
    "restart": "the supervisor's restart policy: not a flag",
    "internal_secret_file": "the gateway's --internal-secret-file",
    "scrub_env": "the client API key variables, and --api-keys-env's",
    "gateway": "the gateway's flags",
}
"""ServeConfig fields without a flag of their own, and why."""


@functools.cache
def serve_flags() -> tuple[Flag, ...]:
    from draftwise.gateway.launcher import ServeConfig

    return table(
        ServeConfig,
        internal=SERVE_INTERNAL,
        options={"num_workers": "--workers", "startup_timeout_s": "--startup-timeout"},
    )


API_SERVER_HTTP_PORT = 8000
"""The api_server's default ``--port`` (vLLM's)."""


def add_serve_args(s: argparse.ArgumentParser, *, api_server: bool = False) -> None:
    """``serve``'s flags on ``s``. ``api_server``: vLLM's api_server's ports instead (``s`` made with
    ``conflict_handler="resolve"``): ``--port`` is the HTTP port (default 8000; ``--http-port`` is
    the same flag), ``--grpc-port`` the gRPC one (default 0: any free port); no positional MODEL."""
    from draftwise.cli.engine_flags import engine_flags
    from draftwise.envflags import apply_env, port_number
    from draftwise.gateway.main import add_gateway_args

    if not api_server:
        s.add_argument(
            "model_tag", nargs="?", default=None, metavar="MODEL", help="the model to serve: the same as --model MODEL"
        )
    add_flags(s, serve_flags())
    engine = s.add_argument_group("engine (every worker's)")
    add_flags(engine, engine_flags())
    engine.add_argument(
        "--model-name",
        default=None,
        help="name clients use for it (default: draftwise-target, a Hugging Face name as given, or the folder's name)",
    )
    gateway = s.add_argument_group("gateway")
    add_gateway_args(gateway)
    if api_server:  # replaces the gateway's --port and --http-port (conflict_handler="resolve")
        gateway.add_argument(
            "--port",
            "--http-port",
            dest="http_port",
            type=port_number,
            default=API_SERVER_HTTP_PORT,
            metavar="PORT",
            help=f"HTTP port of POST /generate and the OpenAI endpoint (default {API_SERVER_HTTP_PORT}; 0: any free one)",
        )
        gateway.add_argument(
            "--grpc-port",
            dest="port",
            type=port_number,
            default=0,
            metavar="PORT",
            help="gRPC port (default 0: any free one)",
        )
    apply_env(s)


def take_positional_model(args: argparse.Namespace) -> str | None:
    """Move ``serve MODEL``'s positional model into ``args.model``; the one-line error when it
    and ``--model`` are both given and differ, else None."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return None
    if args.model is not None and str(args.model) != tag:
        return f"the model is given twice: {tag!r} (positional) and --model {str(args.model)!r}; give one"
    args.model = tag
    return None


def use_local_copies(args: argparse.Namespace) -> None:
    """Hugging Face names among the engine flags, as the workers get them: the served name is the
    name given (vLLM's way: clients ask for ``org/name``) unless ``--model-name`` says another;
    ``--speculative-model``'s is replaced by its local copy's path. Call after
    :func:`~draftwise.cli.engine_flags.path_problem` found none missing."""
    from draftwise.worker.paths import is_hub_name, local_copy

    if args.model is not None and is_hub_name(args.model) and args.model_name is None:
        args.model_name = str(args.model)
    if args.speculative_model is not None and is_hub_name(args.speculative_model):
        args.speculative_model = str(local_copy(str(args.speculative_model)))


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The flags every worker gets: each engine flag whose value is not the default (the
    worker's parser is made from the same table, so it reads back the same EngineConfig), and
    ``--model-name``."""
    from draftwise.cli.engine_flags import engine_flags

    flags = engine_flags()
    out = as_argv(changed(config_values(args, flags), flags), flags)
    if args.model_name is not None:
        out += ["--model-name", args.model_name]
    return out


def run_serve(args: argparse.Namespace) -> int:
    from draftwise.cli.engine_flags import engine_config, path_problem
    from draftwise.gateway.launcher import ServeConfig, serve
    from draftwise.gateway.main import config_from_args, run_loop
    from draftwise.hop import CLIENT_KEY_ENV_VARS
    from draftwise.logs import configure_logging, wrap_native_stderr

    problem = take_positional_model(args)
    try:  # before any worker starts: a worker takes seconds to load
        if problem is None:
            config = engine_config(args)
            problem = path_problem(config)
    except ValueError as e:
        problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    use_local_copies(args)
    try:
        configure_logging(args.log_format, args.log_level)
        wrap_native_stderr(process="serve")  # gRPC core's lines as JSON too, under JSON logs
        cfg = ServeConfig(
            **config_values(args, serve_flags()),
            worker_args=tuple(worker_argv(args)),
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
