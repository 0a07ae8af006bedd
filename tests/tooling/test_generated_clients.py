"""Generated clients and the contract's history: the language options are set alike in every
.proto file; ``buf generate`` (proto/buf.gen.yaml) rewrites exactly the committed Python, Go and
TypeScript code; the client packages hold GenerateService only; the reflection descriptor set
carries the comments; ``buf breaking`` against the last release image passes, and catches a
real break.

Needs buf (DRAFTWISE_REQUIRE_BUF=1), Debian's protoc-gen-go and protoc-gen-go-grpc
(DRAFTWISE_REQUIRE_GO=1) and ``npm ci`` in clients/js (DRAFTWISE_REQUIRE_NODE=1); without the
variable a missing tool skips, with it the test fails."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).parents[2]
PROTO = ROOT / "proto"
GO_DIR = ROOT / "clients" / "go"
JS_DIR = ROOT / "clients" / "js"
GO_GEN = GO_DIR / "draftwisev1"
TS_GEN = JS_DIR / "src" / "gen" / "draftwise" / "v1"
PROTOC_GEN_ES = JS_DIR / "node_modules" / ".bin" / "protoc-gen-es"
GO_PACKAGE = "github.com/draftwise/draftwise/clients/go/draftwisev1;draftwisev1"
RELEASES = PROTO / "releases"


def _need(tool: str, found: bool, env: str, how: str) -> None:
    if not found:
        message = f"{tool} is missing: {how}; set {env}=1 to fail instead"
        if os.environ.get(env):
            pytest.fail(message)
        pytest.skip(message)


def _buf() -> str:
    exe = shutil.which("buf")
    _need("buf", exe is not None, "DRAFTWISE_REQUIRE_BUF", "npm install -g @bufbuild/buf@1.75.0")
    return str(exe)


def _go_plugins() -> None:
    found = all(shutil.which(p) for p in ("protoc-gen-go", "protoc-gen-go-grpc"))
    _need(
        "protoc-gen-go/protoc-gen-go-grpc",
        found,
        "DRAFTWISE_REQUIRE_GO",
        "apt-get install protoc-gen-go protoc-gen-go-grpc",
    )


def _es_plugin() -> None:
    _need("protoc-gen-es", PROTOC_GEN_ES.exists(), "DRAFTWISE_REQUIRE_NODE", "run `npm ci` in clients/js")


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(folder: Path, suffix: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob(f"*{suffix}"))} if folder.is_dir() else {}


# --- language options -------------------------------------------------------------------


def test_every_proto_file_carries_the_same_language_options():
    from draftwise.v1 import generate_service_pb2, generation_pb2, worker_service_pb2

    outer = {}
    for module in (generation_pb2, generate_service_pb2, worker_service_pb2):
        opts = module.DESCRIPTOR.GetOptions()
        assert opts.go_package == GO_PACKAGE, module.__name__
        assert (opts.java_package, opts.java_multiple_files, opts.csharp_namespace) == (
            "com.draftwise.v1",
            True,
            "Draftwise.V1",
        )
        outer[module.DESCRIPTOR.name] = opts.java_outer_classname
    assert outer == {
        "draftwise/v1/generation.proto": "GenerationProto",
        "draftwise/v1/generate_service.proto": "GenerateServiceProto",
        "draftwise/v1/worker_service.proto": "WorkerServiceProto",
    }


def test_protoc_writes_java_and_csharp_where_the_options_say(gen, tmp_path):
    """The options are not decoration: protoc's own generators follow them (Debian's protoc,
    which has the Java and C# generators that grpcio-tools' leaves out)."""
    protoc = shutil.which("protoc")
    _need("protoc", protoc is not None, "DRAFTWISE_REQUIRE_GO", "apt-get install protobuf-compiler")
    (tmp_path / "java").mkdir()
    (tmp_path / "cs").mkdir()
    args = [f"-I{PROTO}", f"--java_out={tmp_path / 'java'}", f"--csharp_out={tmp_path / 'cs'}"]
    res = subprocess.run(
        [str(protoc), *args, *(str(f) for f in gen.proto_files())], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    java = {p.name for p in (tmp_path / "java" / "com" / "draftwise" / "v1").glob("*.java")}
    assert {"GenerateServiceProto.java", "StartGeneration.java", "GenerateRequest.java"} <= java
    assert "namespace Draftwise.V1" in (tmp_path / "cs" / "GenerateService.cs").read_text()


# --- generated code is what buf.gen.yaml makes ------------------------------------------


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`buf generate` run on a copy of the repository's proto/, scripts/ and client folders
    (without their generated files), as buf.gen.yaml says."""
    buf = _buf()
    _go_plugins()
    _es_plugin()
    root = tmp_path_factory.mktemp("regen")
    shutil.copytree(
        PROTO, root / "proto", ignore=shutil.ignore_patterns("*_pb2*", "*.binpb", "__pycache__", "releases")
    )
    shutil.copytree(ROOT / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "clients" / "js" / "node_modules").mkdir(parents=True)
    (root / "clients" / "js" / "node_modules" / ".bin").symlink_to(PROTOC_GEN_ES.parent)
    bindir = root / "bin"  # buf.gen.yaml runs `python`: make it this interpreter
    bindir.mkdir()
    (bindir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bindir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run([buf, "generate"], cwd=root / "proto", env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return root


def _versions(files: dict[str, bytes]) -> set[str]:
    return {m.decode() for data in files.values() for m in re.findall(rb"(protoc-gen-\S+ v[\d.]+)", data[:600])}


def test_buf_generate_matches_committed_python(gen, regenerated):
    """proto/buf.gen.yaml describes the same Python generation as scripts/gen_proto.py (the
    reflection .binpb is that script's alone: a protoc plugin returns text only)."""
    fresh = gen.committed(regenerated / "proto" / "draftwise" / "v1")
    current = {k: v for k, v in gen.committed().items() if not k.endswith(".binpb")}
    assert gen.differences(fresh, current) == []


@pytest.mark.parametrize(
    ("language", "fresh_dir", "committed_dir", "suffix"),
    [
        ("go", Path("clients/go/draftwisev1"), GO_GEN, ".go"),
        ("typescript", Path("clients/js/src/gen/draftwise/v1"), TS_GEN, ".ts"),
    ],
)
def test_committed_client_stubs_are_up_to_date(gen, regenerated, language, fresh_dir, committed_dir, suffix):
    fresh = _files(regenerated / fresh_dir, suffix)
    current = _files(committed_dir, suffix)
    assert len(fresh) == len(current) >= 2, (sorted(fresh), sorted(current))
    diff = gen.differences(fresh, current)
    assert diff == [], (
        f"{language} stubs are out of date; run `buf generate` in proto/ "
        f"(generators here: {sorted(_versions(fresh))}, committed: {sorted(_versions(current))}): {diff}"
    )


def test_client_packages_hold_generate_service_only():
    go = b"".join(_files(GO_GEN, ".go").values())
    ts = b"".join(_files(TS_GEN, ".ts").values())
    assert b"GenerateServiceClient interface" in go and b"export const GenerateService: GenService" in ts
    for code in (go, ts):
        assert b"WorkerServiceGenerateRequest" not in code and b"GetLoadRequest" not in code
    assert not re.search(rb"^type WorkerService", go, re.M)
    assert not re.search(rb"^export const WorkerService", ts, re.M)
    assert sorted(_files(GO_GEN, ".go")) == [
        "generate_service.pb.go",
        "generate_service_grpc.pb.go",
        "generation.pb.go",
    ]
    assert sorted(_files(TS_GEN, ".ts")) == ["generate_service_pb.ts", "generation_pb.ts"]


# --- reflection descriptors carry the comments ------------------------------------------


def _comment(fd: descriptor_pb2.FileDescriptorProto, path: list[int]) -> str:
    for loc in fd.source_code_info.location:
        if list(loc.path) == path:
            return loc.leading_comments
    return ""


def test_reflection_set_carries_the_comments():
    from draftwise.gateway.reflection import contract_files

    files = contract_files()
    assert sorted(files) == ["draftwise/v1/generate_service.proto", "draftwise/v1/generation.proto"]
    svc = files["draftwise/v1/generate_service.proto"]
    assert svc.service[0].name == "GenerateService"
    assert _comment(svc, [6, 0]).startswith(" Text generation.")  # service 0
    assert "multiplexed on one bidirectional stream" in _comment(svc, [6, 0, 2, 0])  # its method 0
    gen_file = files["draftwise/v1/generation.proto"]
    index = [m.name for m in gen_file.message_type].index("SamplingParams")
    assert "Softmax temperature" in _comment(gen_file, [4, index, 2, 0])  # message, field 0


# --- buf breaking against the last release ----------------------------------------------

OPTION_FINDING = re.compile(
    r'^File option "(go_package|java_package|java_multiple_files|java_outer_classname|csharp_namespace)" changed from "(|false)" to '
)
"""What v0.1.0 (released before the language options existed) may differ in: options set from unset."""


def _last_release() -> Path:
    images = sorted(RELEASES.glob("v*.binpb"), key=lambda p: tuple(int(x) for x in p.stem[1:].split(".")))
    assert images, f"no release image in {RELEASES}"
    return images[-1]


def _breaking(buf: str, proto: Path, against: Path) -> list[dict]:
    res = subprocess.run(
        [buf, "breaking", str(proto), "--against", str(against), "--error-format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode in (0, 100), res.stdout + res.stderr
    findings = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert (res.returncode == 100) == bool(findings), res.stdout + res.stderr
    return findings


def test_the_release_image_is_the_v0_1_0_contract():
    image = descriptor_pb2.FileDescriptorSet.FromString((RELEASES / "v0.1.0.binpb").read_bytes())
    names = {f.name for f in image.file}
    assert names == {
        "draftwise/v1/generation.proto",
        "draftwise/v1/generate_service.proto",
        "draftwise/v1/worker_service.proto",
    }
    prompt = next(m for f in image.file for m in f.message_type if m.name == "Prompt")
    assert [f.name for f in prompt.field] == ["text", "token_ids"]  # before Prompt.chat was added


def test_buf_breaking_against_the_last_release():
    buf = _buf()
    release = _last_release()
    findings = _breaking(buf, PROTO, release)
    if release.stem == "v0.1.0":
        unexpected = [f for f in findings if not OPTION_FINDING.match(f["message"])]
    else:
        unexpected = findings
    assert unexpected == [], "\n".join(
        f"{f['path']}:{f['start_line']}: {f['type']}: {f['message']}" for f in unexpected
    )


def test_buf_breaking_catches_a_removed_field(tmp_path):
    buf = _buf()
    proto = tmp_path / "proto"
    shutil.copytree(PROTO, proto, ignore=shutil.ignore_patterns("*_pb2*", "__pycache__", "*.binpb"))
    source = proto / "draftwise" / "v1" / "generation.proto"
    text = source.read_text()
    changed = text.replace("  // Keep generating past the model's EOS token.\n  bool ignore_eos = 9;\n", "")
    assert changed != text
    source.write_text(changed)
    findings = _breaking(buf, proto, _last_release())
    assert any(f["type"] == "FIELD_NO_DELETE" and "ignore_eos" in f["message"] for f in findings), findings


def quoted_breaking_command() -> str:
    """The ``buf breaking`` command proto/buf.yaml's comment quotes for the last release (run in proto/)."""
    comments = [
        line.lstrip("#").strip() for line in (PROTO / "buf.yaml").read_text().splitlines() if line.startswith("#")
    ]
    (command,) = [c for c in comments if c.startswith("buf breaking") and "releases/" in c and ".git" not in c]
    return command


def _run_quoted(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_breaking_command_buf_yaml_quotes_passes_as_written():
    """Run exactly as quoted (no filter of our own), it passes against the last release image."""
    _buf()
    command = quoted_breaking_command()
    assert f"--against releases/{_last_release().name}" in command, command
    res = _run_quoted(command, PROTO)
    assert res.returncode == 0, f"{command}\n{res.stdout}{res.stderr}"


def test_the_quoted_breaking_command_leaves_out_only_the_option_findings(tmp_path):
    """Its --config is buf.yaml's `breaking` section less exactly the rules of the findings the
    release image may differ in (options set from unset), and it still catches a real break."""
    import yaml

    buf = _buf()
    argv = shlex.split(quoted_breaking_command())
    config = json.loads(argv[argv.index("--config") + 1]) if "--config" in argv else {"breaking": {}}
    ours = yaml.safe_load((PROTO / "buf.yaml").read_text())["breaking"]
    assert config["breaking"].get("use") == ours["use"]
    findings = _breaking(buf, PROTO, _last_release())  # buf.yaml's own rules
    allowed = {f["type"] for f in findings if OPTION_FINDING.match(f["message"])}
    assert set(config["breaking"].get("except", [])) == allowed
    proto = tmp_path / "proto"
    shutil.copytree(PROTO, proto, ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"))
    source = proto / "draftwise" / "v1" / "generation.proto"
    text = source.read_text()
    changed = text.replace("  // Keep generating past the model's EOS token.\n  bool ignore_eos = 9;\n", "")
    assert changed != text
    source.write_text(changed)
    res = _run_quoted(quoted_breaking_command(), proto)
    assert res.returncode == 100 and "ignore_eos" in res.stdout, res.stdout + res.stderr


def test_the_reflection_set_ships_in_the_package():
    """The gateway reads generate_service.binpb at start: a wheel without it could not serve."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["draftwise.v1"]
    assert "*.binpb" in data
    assert (PROTO / "draftwise" / "v1" / "generate_service.binpb").is_file()


def test_go_module_path_matches_go_package():
    """go.mod names the module the generated code's import path lives in, with the versions of
    Debian's packages the client is built and tested with (or newer)."""
    lines = [line.strip() for line in (GO_DIR / "go.mod").read_text().splitlines()]
    assert lines[0] == f"module {GO_PACKAGE.split(';')[0].rsplit('/', 1)[0]}"
    assert "go 1.19" in lines
    assert "google.golang.org/grpc v1.33.3" in lines and "google.golang.org/protobuf v1.28.1" in lines
