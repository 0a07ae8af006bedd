"""``draftwise serve``: a gateway and worker processes on this machine
(:mod:`draftwise.gateway.launcher`).

Its flags come from three tables (:mod:`draftwise.flagtable`): ServeConfig's (``--workers``,
``--startup-timeout``, ...), EngineConfig's (every engine flag, checked here before any worker
starts and passed on to each worker when it differs from the default) and GatewayConfig's (the
gateway's flags, the same as ``draftwise gateway``'s).
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


def add_serve_args(s: argparse.ArgumentParser) -> None:
    from draftwise.cli.engine_flags import engine_flags
    from draftwise.envflags import apply_env
    from draftwise.gateway.main import add_gateway_args

    add_flags(s, serve_flags())
    engine = s.add_argument_group("engine (every worker's)")
    add_flags(engine, engine_flags())
    engine.add_argument(
        "--model-name", default=None, help="name clients use for it (default: draftwise-target, or the folder's name)"
    )
    add_gateway_args(s.add_argument_group("gateway"))
    apply_env(s)


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

    try:  # before any worker starts: a worker takes seconds to load
        config = engine_config(args)
        problem = path_problem(config)
    except ValueError as e:
        problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
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
