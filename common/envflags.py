"""Every flag of a command also read from an environment variable, the way container users
expect: ``--port`` from ``DRAFTWISE_PORT``, ``--worker-dns`` from ``DRAFTWISE_WORKER_DNS``.

:func:`apply_env` is called on an argparse parser (``draftwise worker``, ``draftwise gateway``,
``draftwise serve``) once its flags are added. A flag given on the command line wins over its
variable; a variable wins over the flag's default. Values are read when that parser parses (so a
bad variable of another subcommand never matters) and converted exactly as the flag's own value
would be; one that does not convert ends the command with exit status 2 and a line naming the
variable (argparse's usage error), no traceback. ``--help`` shows each flag's variable.

- switches (``--enforce-eager``, ``--no-speculative-adaptive``): ``1``/``true``/``yes``/``on`` or
  ``0``/``false``/``no``/``off``;
- repeatable flags (``--worker``): several values separated by commas or whitespace;
- an empty variable counts as unset.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PREFIX = "DRAFTWISE_"
"""Prefix of every flag's environment variable."""
EXCLUDED = frozenset({"help", "version"})
"""Destinations never read from the environment."""
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})

_UNSET = object()


def env_name(option: str, prefix: str = PREFIX) -> str:
    """``--worker-dns`` -> ``DRAFTWISE_WORKER_DNS``."""
    return prefix + option.lstrip("-").upper().replace("-", "_")


def _long_option(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
    return longs[0] if longs else None


def env_actions(parser: argparse.ArgumentParser, prefix: str = PREFIX) -> dict[str, argparse.Action]:
    """{variable name: action} of every flag of ``parser`` that reads the environment."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        option = _long_option(action)
        if option is None or action.dest in EXCLUDED or isinstance(action, argparse._SubParsersAction):
            continue
        if action.nargs == 0 and not isinstance(
            action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)
        ):
            continue  # --help-like actions (store_const, count) are not configuration
        out[env_name(option, prefix)] = action
    return out


def _convert_one(action: argparse.Action, text: str) -> Any:
    """``text`` converted as argparse converts a flag's value (type, then choices); ValueError."""
    convert: Callable[[str], Any] = action.type if callable(action.type) else str
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None
    except (TypeError, ValueError):
        name = getattr(action.type, "__name__", repr(action.type))
        raise ValueError(f"invalid {name} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"invalid choice: {value!r} (choose from {', '.join(map(repr, action.choices))})")
    return value


def _convert(action: argparse.Action, text: str) -> Any:
    if action.nargs == 0:  # a switch
        word = text.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise ValueError(f"not a switch value: {text!r} (use one of 1, true, yes, on, 0, false, no, off)")
        on = word in TRUE_WORDS
        if isinstance(action, argparse._StoreFalseAction):
            return not on
        return on
    if isinstance(action, argparse._AppendAction):
        return [_convert_one(action, part) for part in re.split(r"[,\s]+", text.strip()) if part]
    return _convert_one(action, text)


def apply_env(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None, prefix: str = PREFIX
) -> argparse.ArgumentParser:
    """Make every flag of ``parser`` also read ``PREFIX + FLAG_NAME`` (see the module doc); the
    environment is ``os.environ`` at parse time unless ``environ`` is given. Returns ``parser``."""
    actions = env_actions(parser, prefix)
    for name, action in actions.items():
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env: {name}]".strip()
    original = parser.parse_known_args

    def parse_known_args(
        args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        env = os.environ if environ is None else environ
        given = {name: env[name] for name in actions if env.get(name, "").strip()}
        saved = {name: (a.default, a.required) for name, a in actions.items()}
        try:
            for name, action in actions.items():
                if name in given:
                    # None for a repeatable flag (argparse appends to a copy of the default)
                    action.default = None if isinstance(action, argparse._AppendAction) else _UNSET
                    action.required = False
            ns, rest = original(args, namespace)
            assert ns is not None  # argparse always returns a namespace
        finally:
            for name, action in actions.items():
                action.default, action.required = saved[name]
        for name, text in given.items():
            action = actions[name]
            current = getattr(ns, action.dest, _UNSET)
            if current is not _UNSET and current is not None:
                continue  # given on the command line: it wins
            try:
                setattr(ns, action.dest, _convert(action, text))
            except ValueError as e:
                parser.error(f"environment variable {name}={text!r}: {e}")
        return ns, rest

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    return parser


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: use 1-65535 (or 0 for any free port)")
    return port
