"""Generate the Python code of the gRPC contract: the one command for it.

    python scripts/gen_proto.py           # (re)write proto/draftwise/v1/*_pb2{.py,.pyi,_grpc.py}
    python scripts/gen_proto.py --check   # exit 1 when the committed files differ from fresh output

protoc runs from ``grpc_tools`` (pip install grpcio-tools) with ``-I proto``, so generated
modules import each other as ``draftwise.v1.<name>_pb2``. The output depends on the
grpcio-tools version (it is stamped into the files), so generation is pinned to
``GRPC_TOOLS_VERSION``; ``--any-version`` overrides that for experiments.

It also writes ``generate_service.binpb``: the public contract (GenerateService and the files it
imports) as a FileDescriptorSet *with* source code info, i.e. the proto comments, which the
gateway serves through server reflection (the descriptors inside the *_pb2.py modules carry
none).

``--protoc-plugin`` makes this script a protoc plugin, so that ``buf generate`` (see
proto/buf.gen.yaml) drives the same generators and writes byte-identical Python files (a
protoc plugin can only return text, so the .binpb comes from this command alone).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = PROTO_ROOT / "draftwise" / "v1"
GRPC_TOOLS_VERSION = "1.85.1"
"""The grpcio-tools release the committed files were generated with."""
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", ".binpb")
"""Endings of the files this script writes; nothing else in PACKAGE_DIR is touched."""
REFLECTION_SET = "generate_service.binpb"
"""FileDescriptorSet of generate_service.proto and its imports, with source info (comments)."""
PUBLIC_PROTO = "draftwise/v1/generate_service.proto"
"""The file of the public service, the root of REFLECTION_SET."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files of the contract, relative to ``proto_root``, sorted."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / "draftwise" / "v1").glob("*.proto"))


def is_generated(path: Path) -> bool:
    """Whether ``path`` is a file protoc writes (as opposed to ``__init__.py``, .proto...)."""
    return path.name.endswith(GENERATED_SUFFIXES)


def grpc_tools_version() -> str:
    """The installed grpcio-tools version ("" when it is not installed)."""
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _protoc(args: list[str]) -> None:
    """Run grpc_tools' protoc (well-known types on the include path) in a subprocess.

    A subprocess keeps protoc's process-wide state from leaking between calls.
    """
    code = (
        "import sys, importlib.resources, grpc_tools.protoc as p\n"
        "wkt = str(importlib.resources.files('grpc_tools') / '_proto')\n"
        "sys.exit(p.main(['protoc', '-I' + wkt] + sys.argv[1:]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"protoc failed ({res.returncode}):\n{res.stdout}{res.stderr}")


def _out_args(out_dir: Path) -> list[str]:
    """protoc flags for every generator: messages, type stubs, gRPC stubs."""
    return [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> dict[str, bytes]:
    """Run protoc on every .proto under ``proto_root`` into ``out_dir``; return {name: bytes}."""
    files = proto_files(proto_root)
    if not files:
        raise SystemExit(f"no .proto files under {proto_root / 'draftwise' / 'v1'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    _protoc([f"-I{proto_root}", *_out_args(out_dir), *(str(f) for f in files)])
    pkg = out_dir / "draftwise" / "v1"
    reflection_set = pkg / REFLECTION_SET
    _protoc(
        [f"-I{proto_root}", "--include_source_info", "--include_imports", f"--descriptor_set_out={reflection_set}"]
        + [PUBLIC_PROTO]
    )
    return {p.name: p.read_bytes() for p in sorted(pkg.iterdir()) if is_generated(p)}


def _default_json_name(name: str) -> str:
    """protoc's default JSON name of a field: lowerCamelCase of its snake_case name."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def protoc_plugin() -> int:
    """Act as a protoc plugin: CodeGeneratorRequest on stdin, CodeGeneratorResponse on stdout.

    The descriptors (compiled by buf) go to grpc_tools' protoc as a descriptor set. buf fills
    in every field's json_name while protoc records only explicit ones, and the descriptor
    is embedded in the *_pb2.py files, so default json_names are dropped first: the output
    is then byte-identical to ``generate``'s.
    """
    from google.protobuf import descriptor_pb2
    from google.protobuf.compiler import plugin_pb2

    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    files = descriptor_pb2.FileDescriptorSet(file=request.proto_file)
    stack = [m for f in files.file for m in f.message_type]
    while stack:
        message = stack.pop()
        stack.extend(message.nested_type)
        for field in [*message.field, *message.extension]:
            if field.json_name == _default_json_name(field.name):
                field.ClearField("json_name")
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    with tempfile.TemporaryDirectory() as tmp:
        descriptor_set = Path(tmp) / "files.binpb"
        descriptor_set.write_bytes(files.SerializeToString())
        out_dir = Path(tmp) / "out"
        out_dir.mkdir()
        _protoc([f"--descriptor_set_in={descriptor_set}", *_out_args(out_dir), *request.file_to_generate])
        for path in sorted(p for p in out_dir.rglob("*") if p.is_file()):
            response.file.add(name=path.relative_to(out_dir).as_posix(), content=path.read_text())
    sys.stdout.buffer.write(response.SerializeToString())
    return 0


def committed(package_dir: Path = PACKAGE_DIR) -> dict[str, bytes]:
    """The generated files now in ``package_dir``: {name: bytes}."""
    return {p.name: p.read_bytes() for p in sorted(package_dir.iterdir()) if is_generated(p)}


def differences(fresh: dict[str, bytes], current: dict[str, bytes]) -> list[str]:
    """One line per file that is missing, stale or different in ``current``; [] if equal."""
    lines = []
    for name in sorted(fresh.keys() | current.keys()):
        if name not in current:
            lines.append(f"missing: {name}")
        elif name not in fresh:
            lines.append(f"stale (no .proto makes it): {name}")
        elif fresh[name] != current[name]:
            lines.append(f"out of date: {name}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with fresh output; exit 1 when it differs")
    parser.add_argument(
        "--any-version", action="store_true", help=f"run with any grpcio-tools, not only {GRPC_TOOLS_VERSION}"
    )
    parser.add_argument(
        "--protoc-plugin", action="store_true", help="run as a protoc plugin (what proto/buf.gen.yaml uses)"
    )
    args = parser.parse_args(argv)

    have = grpc_tools_version()
    if not have:
        print(f"grpcio-tools is not installed: pip install grpcio-tools=={GRPC_TOOLS_VERSION}", file=sys.stderr)
        return 2
    if have != GRPC_TOOLS_VERSION and not args.any_version:
        print(
            f"the generated code is made with grpcio-tools=={GRPC_TOOLS_VERSION}, this is {have}: "
            f"pip install grpcio-tools=={GRPC_TOOLS_VERSION} (or bump GRPC_TOOLS_VERSION and regenerate)",
            file=sys.stderr,
        )
        return 2
    if args.protoc_plugin:
        return protoc_plugin()

    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    current = committed()
    diff = differences(fresh, current)

    if args.check:
        if diff:
            print("generated code is out of date; run: python scripts/gen_proto.py", file=sys.stderr)
            print("\n".join(diff), file=sys.stderr)
            return 1
        print(f"generated code is up to date ({len(fresh)} files)")
        return 0

    for name, data in fresh.items():
        if current.get(name) != data:
            (PACKAGE_DIR / name).write_bytes(data)
    for name in current.keys() - fresh.keys():
        (PACKAGE_DIR / name).unlink()
    print("\n".join(diff) if diff else f"nothing to do ({len(fresh)} files up to date)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
