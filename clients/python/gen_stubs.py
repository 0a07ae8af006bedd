"""Generate the client's vendored stubs: the one command for them.

    python clients/python/gen_stubs.py           # (re)write draftwise_client/_proto/*_pb2*
    python clients/python/gen_stubs.py --check   # exit 1 when they differ from fresh output

It runs the repository's own generator (``scripts/gen_proto.py``, the pinned grpcio-tools)
on ``proto/draftwise/v1``, keeps the GenerateService files, and rewrites their imports from
``draftwise.v1`` to ``draftwise_client._proto``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE / "draftwise_client" / "_proto"
KEEP = (
    "generation_pb2.py",
    "generation_pb2.pyi",
    "generate_service_pb2.py",
    "generate_service_pb2.pyi",
    "generate_service_pb2_grpc.py",
)
"""The generated files the client needs (no WorkerService: that API is internal)."""


def _gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rewrite(data: bytes) -> bytes:
    """Imports and module names of ``draftwise.v1`` -> ``draftwise_client._proto``."""
    text = data.decode()
    text = text.replace("from draftwise.v1 import ", "from draftwise_client._proto import ")
    text = text.replace("'draftwise.v1.", "'draftwise_client._proto.")  # the classes' __module__
    return text.encode()


def fresh() -> dict[str, bytes]:
    gen = _gen_proto()
    have = gen.grpc_tools_version()
    if have != gen.GRPC_TOOLS_VERSION:
        raise SystemExit(f"pip install grpcio-tools=={gen.GRPC_TOOLS_VERSION} (found {have or 'none'})")
    with tempfile.TemporaryDirectory() as tmp:
        files = gen.generate(Path(tmp))
    return {name: rewrite(files[name]) for name in KEEP}


def current() -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted(OUT.iterdir()) if p.name.endswith(("_pb2.py", "_pb2.pyi", "_grpc.py"))
    }


def differences(new: dict[str, bytes], old: dict[str, bytes]) -> list[str]:
    out = []
    for name in sorted(new.keys() | old.keys()):
        if name not in old:
            out.append(f"missing: {name}")
        elif name not in new:
            out.append(f"stale: {name}")
        elif new[name] != old[name]:
            out.append(f"out of date: {name}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with fresh output; exit 1 when it differs")
    args = p.parse_args(argv)
    new, old = fresh(), current()
    diff = differences(new, old)
    if args.check:
        if diff:
            print("client stubs are out of date; run: python clients/python/gen_stubs.py", file=sys.stderr)
            print("\n".join(diff), file=sys.stderr)
            return 1
        print(f"client stubs are up to date ({len(new)} files)")
        return 0
    for name, data in new.items():
        (OUT / name).write_bytes(data)
    for name in old.keys() - new.keys():
        (OUT / name).unlink()
    print("\n".join(diff) if diff else "nothing to do")
    return 0


if __name__ == "__main__":
    sys.exit(main())
