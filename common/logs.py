"""structlog setup shared by the gateway, the worker and ``draftwise serve``: JSON lines in production,
a console renderer in a terminal. Every line about a request carries its ``request_id``."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from datetime import UTC, datetime
from typing import IO, Literal, TextIO, cast

import structlog

LogFormat = Literal["auto", "json", "console"]

_ABSL_PREFIX = re.compile(r"^([IWEF])\d{4} ")
"""The start of a line absl (gRPC core's logger) writes: severity letter, month and day."""

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


def as_json_line(line: bytes, **fields: str) -> bytes:
    """``line`` (one line another process wrote to stderr) as a JSON log line: unchanged when it
    is one already, else a record with the text as its event, ``fields`` (which process), and
    the level a gRPC core line carries (absl's prefix: E, W, I or F and the date)."""
    text = line.decode(errors="replace").rstrip("\n")
    if text.startswith("{"):
        try:
            if isinstance(json.loads(text), dict):
                return line if line.endswith(b"\n") else line + b"\n"
        except ValueError:
            pass
    absl = _ABSL_PREFIX.match(text)  # gRPC core: "E1202 04:28:03.123456  123 chttp2_transport.cc:...] ..."
    level = {"E": "error", "F": "critical", "W": "warning"}.get(absl[1], "info") if absl else "info"
    if not absl and text.startswith(("Traceback", "error:")):
        level = "error"
    record = {"event": text, "level": level, "stream": "stderr", **fields}
    record["timestamp"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    return (json.dumps(record) + "\n").encode()


_native_wrapped = False


def wrap_native_stderr(**fields: str) -> None:
    """Under JSON logs, make what native code (gRPC core, C libraries) writes to file descriptor 2
    JSON lines too: fd 2 becomes a pipe that a daemon thread reads, writing each line through
    :func:`as_json_line` (``fields`` name the process) to the original stderr, while Python's own
    ``sys.stderr`` writes there directly (its lines are JSON already, and none waits on the thread).
    Called once by each process entry point after :func:`configure_logging`; nothing off JSON."""
    global _native_wrapped
    if not _json_lines or _native_wrapped:
        return
    _native_wrapped = True
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr = open(original, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115

    def pump() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                data = as_json_line(line, **fields)
                while data:
                    try:
                        data = data[os.write(original, data) :]
                    except OSError:
                        break

    threading.Thread(target=pump, name="native-stderr", daemon=True).start()
