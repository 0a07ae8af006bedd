"""The Python client's shape: small modules, one sans-IO core that decides retries and resumes,
and drivers (asyncio and blocking, one request or a session) that only carry its actions out."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "python"
CORE = PACKAGE / "draftwise_client" / "_core.py"
DRIVERS = ["_aio.py", "_aio_session.py", "_sync.py", "_sync_session.py"]
MAX_LINES = 450


def _imports(path: Path) -> set[str]:
    """Every module and module.name the file imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_client_file_is_long():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if "build" not in p.parts and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_core_does_no_io():
    """No clock, no sleeping, no event loop, no threads, no calls on a channel."""
    imports = _imports(CORE)
    banned = {"time", "asyncio", "threading", "queue", "socket", "draftwise_client._proto.generate_service_pb2_grpc"}
    assert not imports & banned, imports & banned
    text = CORE.read_text()
    for needle in ("grpc.aio", "channel", "sleep(", "monotonic("):
        assert needle not in text, needle


def test_the_drivers_decide_nothing():
    """Retry and resume decisions live in the core alone: no driver reaches for the policies'
    decision functions or filters events itself."""
    decisions = {
        "draftwise_client._retry.retry_delay",
        "draftwise_client._resume.resume_delay",
        "draftwise_client._resume.resume_outcome",
        "draftwise_client._types.delta_from_event",
    }
    for name in DRIVERS:
        path = PACKAGE / "draftwise_client" / name
        found = _imports(path) & decisions
        assert not found, (name, found)
        assert ".accept(" not in path.read_text(), name
