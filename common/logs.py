"""structlog setup shared by the gateway, the worker and ``draftwise serve``: JSON lines in production,
a console renderer in a terminal. Every line about a request carries its ``request_id``."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Literal, TextIO, cast

import structlog

LogFormat = Literal["auto", "json", "console"]

_json_lines = False
"""Whether :func:`configure_logging` chose JSON lines (read by :func:`announce`)."""


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at each write, not the object it was at configuration (a
    stream swapped and closed since, as pytest's capture does, must not break logging)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: LogFormat = "auto", level: str = "info") -> None:
    """Route structlog to stderr as JSON (or console text when ``fmt`` is "console", or
    "auto" on a terminal), dropping lines below ``level``."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}: debug, info, warning or error")
    global _json_lines
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    _json_lines = not console
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=True,
    )


def ensure_logging(level: str = "info") -> None:
    """Library use (``LLM``, ``LLMEngine``): unless the application configured structlog
    itself, log at ``level`` and above to stderr, so per-request debug lines stay quiet."""
    if not structlog.is_configured():
        configure_logging("auto", level)


def json_lines() -> bool:
    """Whether the process logs JSON lines (then every line it writes for a person is one too)."""
    return _json_lines


def announce(text: str, file: IO[str] | None = None, level: str = "info") -> None:
    """A line for the person who started the process (where it listens, workers ready, a start-up
    error) on ``file`` (stdout by default): plain text, or, when the process logs JSON lines, a
    JSON record with ``text`` as its event (the fields structlog's lines have), so that a log
    collector reads every line."""
    out = sys.stdout if file is None else file
    if _json_lines:
        record = {"event": text, "level": level, "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z")}
        text = json.dumps(record)
    print(text, file=out, flush=True)
