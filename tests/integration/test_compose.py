"""docker-compose.yml proved without a container runtime: it validates against the compose
specification, and its default services run here as local processes, each with its own
command and environment, and a completion streams through the gateway it describes.

The only translations from containers to processes:
- every replica of a service gets its own loopback address (127.x.y.z), and the service's name
  (and network aliases) maps to those addresses through a hosts file the processes resolve
  with (``DRAFTWISE_HOSTS_FILE``, the gateway's ``--hosts-file``); a value ``0.0.0.0`` (listen
  everywhere) and the host ``localhost`` in a health check become the replica's address;
- a volume's mount point becomes a folder of the test (the same folder for every service that
  mounts the volume);
- ``draftwise`` and ``python`` are this environment's; ``DRAFTWISE_PARENT_PID`` ties each
  process to the test so that none outlives it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.procs import ROOT, child_env
from tests.integration.test_discovery import loopback_addresses, wait_for

COMPOSE = ROOT / "docker-compose.yml"


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_is_valid() -> None:
    p = subprocess.run(
        [
            str(Path(sys.executable).parent / "check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            str(COMPOSE),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_compose_has_what_the_docs_promise() -> None:
    services = load_compose()["services"]
    assert services["worker"]["deploy"]["replicas"] == 2
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "worker" in gpu["networks"]["default"]["aliases"]  # discovered under the same name
    for name in ("worker", "worker-gpu", "gateway"):
        s = services[name]
        assert s["restart"] == "unless-stopped"
        assert s["healthcheck"]["test"][:3] == ["CMD", "draftwise", "health"]
        assert s["environment"]["DRAFTWISE_INTERNAL_SECRET_FILE"].startswith("/run/draftwise/")
    assert "9090:9090" in services["gateway"]["ports"] and "50051:50051" in services["gateway"]["ports"]


class Replica:
    """One replica of a compose service as a local process."""

    def __init__(self, service: str, index: int, spec: dict[str, Any], address: str) -> None:
        self.service, self.index, self.spec, self.address = service, index, spec, address
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_file: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.service}-{self.index}"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file and self.log_file.exists() else ""


def translate(value: str, replica: Replica, mounts: dict[str, Path]) -> str:
    if value == "0.0.0.0":
        return replica.address
    if value.startswith("localhost:"):
        return replica.address + value[len("localhost") :]
    for target, folder in mounts.items():
        if value == target or value.startswith(target + "/"):
            return str(folder) + value[len(target) :]
    return value


def local_argv(command: list[str]) -> list[str]:
    program = {"draftwise": str(Path(sys.executable).parent / "draftwise"), "python": sys.executable}
    return [program.get(command[0], command[0]), *command[1:]]


@pytest.mark.slow
def test_compose_services_run_as_processes(tmp_path: Path) -> None:
    compose = load_compose()
    services = {n: s for n, s in compose["services"].items() if not s.get("profiles")}  # the default profile
    replicas: dict[str, list[Replica]] = {}
    count = sum(s.get("deploy", {}).get("replicas", 1) for s in services.values())
    addresses = iter(loopback_addresses(count))
    for name, spec in services.items():
        replicas[name] = [
            Replica(name, i, spec, next(addresses)) for i in range(spec.get("deploy", {}).get("replicas", 1))
        ]
    # names as the compose network's DNS answers them: a service's name and aliases, one address per replica
    hosts: dict[str, list[str]] = {}
    for name, spec in services.items():
        aliases = spec.get("networks", {}).get("default", {}).get("aliases", []) if spec.get("networks") else []
        for n in (name, *aliases):
            hosts.setdefault(n, []).extend(r.address for r in replicas[name])
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(f"{a} {n}\n" for n, addrs in hosts.items() for a in addrs))
    volumes = {v: tmp_path / f"volume-{v}" for v in compose.get("volumes", {})}
    for folder in volumes.values():
        folder.mkdir(mode=0o700)

    def mounts(spec: dict[str, Any]) -> dict[str, Path]:
        out = {}
        for entry in spec.get("volumes", []):
            source, target = entry.split(":")[:2]
            out[target] = volumes[source]
        return out

    # every port a service listens on must be free on its address: the file's own ports are kept
    for rs in replicas.values():
        for r in rs:
            port = r.spec.get("environment", {}).get("DRAFTWISE_PORT")
            if port:
                assert _free(r.address, int(port)), f"{r.address}:{port} is taken"

    def launch(r: Replica) -> None:
        m = mounts(r.spec)
        env = child_env(DRAFTWISE_HOSTS_FILE=str(hosts_file), DRAFTWISE_PARENT_PID=str(os.getpid()))
        env.update({k: translate(str(v), r, m) for k, v in r.spec.get("environment", {}).items()})
        r.log_file = tmp_path / f"{r.name}.log"
        with open(r.log_file, "wb") as log:
            r.popen = subprocess.Popen(
                local_argv([translate(str(a), r, m) for a in r.spec["command"]]),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp_path,
            )

    def healthcheck(r: Replica) -> subprocess.CompletedProcess[str]:
        test = r.spec["healthcheck"]["test"]
        assert test[0] == "CMD"
        argv = local_argv([translate(str(a), r, mounts(r.spec)) for a in test[1:]])
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=child_env())

    started: list[Replica] = []
    try:
        # one-shot services that others wait for (condition: service_completed_successfully) run first
        one_shot = {
            dep
            for s in services.values()
            for dep, cond in (s.get("depends_on") or {}).items()
            if cond.get("condition") == "service_completed_successfully"
        }
        for name in sorted(one_shot):
            for r in replicas[name]:
                launch(r)
                assert r.popen.wait(60) == 0, r.log()
        secret = next(iter(volumes.values())) / "internal-secret"
        assert len(secret.read_text().strip()) >= 16 and secret.stat().st_mode & 0o077 == 0
        for name in services:
            if name not in one_shot:
                for r in replicas[name]:
                    launch(r)
                    started.append(r)
        # the health checks the file declares say SERVING for every long-running replica
        for r in started:

            def serving(r: Replica = r) -> bool:
                assert r.popen.poll() is None, f"{r.name} exited:\n{r.log()[-3000:]}"
                return healthcheck(r).returncode == 0

            wait_for(f"{r.name} healthy", serving, timeout=180)
        gateway = replicas["gateway"][0]
        port = gateway.spec["ports"][0].split(":")[-1]
        # every worker replica was discovered through the service name
        metrics_port = gateway.spec["environment"]["DRAFTWISE_METRICS_PORT"]

        def all_workers_up() -> bool:
            import urllib.request

            text = urllib.request.urlopen(f"http://{gateway.address}:{metrics_port}/metrics", timeout=5).read().decode()
            up = [
                line
                for line in text.splitlines()
                if line.startswith("draftwise_worker_healthy{") and line.endswith(" 1.0")
            ]
            return len(up) == len(replicas["worker"])

        wait_for("both workers behind the gateway", all_workers_up, timeout=60)
        # the README's command, against the gateway the file describes
        p = subprocess.run(
            local_argv(["draftwise", "generate", "def fibonacci(n):", "--server", f"{gateway.address}:{port}"])
            + ["--max-tokens", "16", "--wait", "30"],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
        )
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("def fibonacci(n):") and len(p.stdout.strip()) > len("def fibonacci(n):")
        # the OpenAI-compatible endpoint on the port the file publishes
        import json
        import urllib.request

        http_port = gateway.spec["environment"]["DRAFTWISE_HTTP_PORT"]
        assert f"{http_port}:{http_port}" in gateway.spec["ports"]
        body = json.dumps({"model": "draftwise-target", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        req = urllib.request.Request(
            f"http://{gateway.address}:{http_port}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            completion = json.loads(r.read())
        assert completion["usage"]["completion_tokens"] == 8 and completion["choices"][0]["text"]
    finally:
        for r in started:
            if r.popen is not None and r.popen.poll() is None:
                r.popen.terminate()
        deadline = time.monotonic() + 20
        for r in started:
            if r.popen is not None:
                try:
                    r.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    r.popen.kill()
                    r.popen.wait()


def _free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
