"""The deployment files cannot drift from the code: the Kubernetes manifests validate against the
Kubernetes schemas (kubernetes-validate, offline) and their commands, flags and environment are
what the real parsers accept; the compose services' environment too; the Dockerfile's stages
copy files that exist and run ``draftwise`` subcommands that exist, and the torch-free gateway
image installs every distribution the gateway imports."""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from draftwise.envflags import env_actions
from draftwise.gateway.discovery import dns_target
from draftwise.gateway.main import build_parser as gateway_parser
from draftwise.hop import read_secret_file
from draftwise.worker.serving.server import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests are checked against (native gRPC probes are GA since 1.27)."""
PARSERS = {"gateway": gateway_parser, "worker": worker_parser}


def kustomize_files(folder: Path) -> list[Path]:
    """The resource files of a kustomization, overlays' bases included."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    out: list[Path] = []
    for entry in k["resources"]:
        path = (folder / entry).resolve()
        out += kustomize_files(path) if path.is_dir() else [path]
    return out


def resources(files: list[Path]) -> Iterator[tuple[Path, dict[str, Any]]]:
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                yield f, doc


ALL_FILES = kustomize_files(K8S / "gpu")
ALL = list(resources(ALL_FILES))


def test_kustomizations_list_every_manifest() -> None:
    listed = set(ALL_FILES)
    on_disk = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk == listed, on_disk ^ listed
    assert set(kustomize_files(K8S)) == listed - {(K8S / "gpu" / "workers-gpu.yaml").resolve()}


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(K8S)))
def test_manifests_validate(path: Path) -> None:
    for _f, doc in resources([path]):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_can_fail() -> None:
    doc = copy.deepcopy(next(d for _f, d in ALL if d["kind"] == "StatefulSet"))
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    doc = copy.deepcopy(next(d for _f, d in ALL if d["kind"] == "Deployment"))
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _kind(kind: str) -> list[dict[str, Any]]:
    return [d for _f, d in ALL if d["kind"] == kind]


def _config_maps() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["data"] for d in _kind("ConfigMap")}


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_config_maps()[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        env[item["name"]] = item["value"]
    return env


def parse_with_env(
    parser: argparse.ArgumentParser, argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """``argv`` parsed by the real parser with ``env`` as the environment; every DRAFTWISE_ variable must be a flag's."""
    known = env_actions(parser)
    unknown = sorted(k for k in env if k.startswith("DRAFTWISE_") and k not in known)
    assert not unknown, f"variables no flag of {parser.prog} reads: {unknown}"
    with monkeypatch.context() as m:
        for k in [k for k in list(__import__("os").environ) if k.startswith("DRAFTWISE_")]:
            m.delenv(k)
        for k, v in env.items():
            m.setenv(k, v)
        try:
            return parser.parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"{parser.prog} {argv} with {env} does not parse (exit {e.code})") from None


def _workloads() -> list[dict[str, Any]]:
    return _kind("Deployment") + _kind("StatefulSet")


def test_manifest_commands_and_env_are_flags_we_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for workload in _workloads():
        for c in workload["spec"]["template"]["spec"]["containers"]:
            command = [*c.get("command", []), *c.get("args", [])]
            assert command[0] == "draftwise" and command[1] in PARSERS, command
            args = parse_with_env(PARSERS[command[1]](), command[2:], _container_env(c), monkeypatch)
            seen.add(command[1])
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["grpc"] == args.port
            assert args.host == "0.0.0.0"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if "grpc" in c.get(probe, {}):
                    assert c[probe]["grpc"]["port"] == args.port, (workload["metadata"]["name"], probe)
            # the internal secret: the Secret's key mounted where --internal-secret-file points
            secret_file = Path(args.internal_secret_file)
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(secret_file.parent))
            volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
            secret = next(s for s in _kind("Secret") if s["metadata"]["name"] == volume["secret"]["secretName"])
            assert secret_file.name in secret["stringData"]
            if command[1] == "gateway":
                assert args.metrics_port == ports["metrics"]
                # discovery names the workers' headless Service and its port
                ((name, port),) = args.worker_dns
                service = next(s for s in _kind("Service") if s["metadata"]["name"] == name)
                assert service["spec"]["clusterIP"] == "None"
                assert port == service["spec"]["ports"][0]["port"]
            if workload["kind"] == "StatefulSet":
                labels = workload["spec"]["template"]["metadata"]["labels"]
                service = next(s for s in _kind("Service") if s["metadata"]["name"] == workload["spec"]["serviceName"])
                assert service["spec"]["selector"].items() <= labels.items()
    assert seen == {"gateway", "worker"}


def test_gpu_variant_requests_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = next(s for s in _kind("StatefulSet") if s["metadata"]["name"].endswith("-gpu"))
    c = gpu["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = parse_with_env(worker_parser(), c["command"][2:], _container_env(c), monkeypatch)
    assert args.device == "cuda"


def test_disruption_budgets_and_config_cover_the_workloads() -> None:
    pdbs = [p["spec"]["selector"]["matchLabels"] for p in _kind("PodDisruptionBudget")]
    for workload in _workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(sel.items() <= labels.items() for sel in pdbs), workload["metadata"]["name"]


def test_placeholder_secret_is_refused(tmp_path: Path) -> None:
    (secret,) = _kind("Secret")
    f = tmp_path / "internal-secret"
    f.write_text(secret["stringData"]["internal-secret"])
    f.chmod(0o600)
    with pytest.raises(ValueError, match="it needs at least 16"):
        read_secret_file(f)
    # the documented replacement (docs/deploy.md) touches that value alone and makes a secret both sides accept
    docs = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r'sed -i "s/([^/]+)/\$\(python3 -c \'([^\']+)\'\)/" deploy/kubernetes/secret.yaml', docs)
    assert m, "docs/deploy.md shows how to replace the placeholder"
    text = (K8S / "secret.yaml").read_text()
    assert text.count(m.group(1)) == 1
    value = subprocess.run([sys.executable, "-c", m.group(2)], capture_output=True, text=True, check=True).stdout
    (doc,) = yaml.safe_load_all(text.replace(m.group(1), value.strip()))
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    f.write_text(doc["stringData"]["internal-secret"])
    assert len(read_secret_file(f)) >= 32


# --------------------------------------------------------------------------- compose


def test_compose_env_and_commands_are_flags_we_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    seen = set()
    for name, s in compose["services"].items():
        command = s["command"]
        if command[0] != "draftwise":
            continue
        args = parse_with_env(PARSERS[command[1]](), command[2:], dict(s["environment"]), monkeypatch)
        seen.add(name)
        health = s["healthcheck"]["test"]
        assert health[1:4] == ["draftwise", "health", f"localhost:{args.port}"], name
        if command[1] == "gateway":
            (target,) = args.worker_dns
            assert target == dns_target("worker:50061") and "worker" in compose["services"]
    assert seen == {"worker", "worker-gpu", "gateway"}


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            m = re.match(r"\S+\s+AS\s+(\S+)$", rest, re.IGNORECASE)
            assert m, f"every stage is named: FROM {rest}"
            current = out.setdefault(m.group(1), [])
        current.append((word, rest))
    return out


def dockerignored() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerfile_stages_and_copies() -> None:
    s = stages()
    assert {"gateway", "worker"} <= s.keys()
    ignored = dockerignored()
    for name, instructions in s.items():
        for word, rest in instructions:
            if word != "COPY":
                continue
            parts = rest.split()
            if parts[0].startswith("--from="):
                assert parts[0].split("=", 1)[1] in s, f"{name}: COPY from an unknown stage: {rest}"
                continue
            for source in parts[:-1]:
                assert (ROOT / source).exists(), f"{name}: COPY of a missing file: {source}"
                assert source not in ignored, f"{name}: COPY of a file .dockerignore leaves out: {source}"
    # the package's own build needs every package folder of pyproject.toml, and the readme
    copied = {p for _w, rest in s["wheel"] if _w == "COPY" for p in rest.split()[:-1]}
    pyproject = (ROOT / "pyproject.toml").read_text()
    folders = set(re.findall(r'^"draftwise[.\w]*" = "([\w]+)', pyproject, re.MULTILINE))
    assert folders and folders <= copied, folders - copied
    assert "README.md" in copied and "pyproject.toml" in copied


@pytest.mark.parametrize("stage", ["gateway", "worker"])
def test_dockerfile_commands_exist(stage: str) -> None:
    cmds = [json.loads(rest) for word, rest in stages()[stage] if word in ("CMD", "ENTRYPOINT")]
    assert cmds, f"stage {stage} has no CMD"
    for cmd in cmds:
        assert cmd[0] == "draftwise", cmd
        p = subprocess.run(
            [str(Path(sys.executable).parent / "draftwise"), *cmd[1:], "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
        assert f"usage: draftwise {cmd[1]}" in p.stdout


def _requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec.strip().strip('"'), maxsplit=1)[0].lower().replace("_", "-")


def gateway_packages() -> set[str]:
    run = " ".join(rest for word, rest in stages()["gateway"] if word == "RUN")
    first = run.split("&&")[0]
    assert first.strip().startswith("pip install")
    return {_requirement_name(x) for x in re.findall(r'"([^"]+)"', first)}


def _closure(names: set[str]) -> set[str]:
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        for req in importlib.metadata.requires(name) or []:
            marker = Requirement(req).marker
            if marker is None or marker.evaluate({"extra": ""}):  # not for an extra, nor another platform/Python
                todo.append(_requirement_name(req))
    return out


def test_gateway_image_is_torch_free_and_complete() -> None:
    packages = gateway_packages()
    declared = {_requirement_name(d) for d in importlib.metadata.requires("draftwise") if "extra ==" not in d}
    assert packages <= declared, packages - declared  # the same dependencies pyproject.toml declares
    assert not packages & {"torch", "transformers", "numpy", "tokenizers", "safetensors"}
    # the gateway and `draftwise health` run with only the image's distributions importable: any other
    # (torch, transformers, numpy, and whatever else this test environment has) is blocked
    allowed = sorted(_closure(packages) | {"draftwise"})
    p = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORTS, json.dumps(allowed)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "usage: draftwise gateway" in p.stdout and "usage: draftwise health" in p.stdout
    blocked = set(json.loads(p.stdout.splitlines()[-1]))
    assert "torch" not in blocked  # never even tried


BLOCKED_IMPORTS = """
import contextlib, importlib.abc, importlib.machinery, importlib.metadata, json, sys

allowed = set(json.loads(sys.argv[1]))
owners = importlib.metadata.packages_distributions()
blocked = set()


def norm(name):
    return name.lower().replace("_", "-")


class Hide(importlib.abc.MetaPathFinder):
    # the path finder, blind to modules of distributions the image does not install: they are
    # absent, for imports and for optional-dependency probes (importlib.util.find_spec) alike

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        dists = {norm(d) for d in owners.get(top, [])}
        if dists and not dists & allowed:
            blocked.add(top)
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)


sys.meta_path = [Hide() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import draftwise.cli, draftwise.gateway.main, draftwise.gateway.server, draftwise.health_cli, uvloop

for argv in (["gateway", "--help"], ["health", "--help"]):
    with contextlib.suppress(SystemExit):
        draftwise.cli.main(argv)
assert draftwise.cli.main(["health", "127.0.0.1:1", "--timeout", "2"]) == 1  # a real check: nobody listens there
print(json.dumps(sorted(blocked)))
"""
