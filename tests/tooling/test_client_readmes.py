"""Commands the client READMEs quote run as written: clients/go/README.md's GOPATH build (Debian's
Go and packages, offline) builds the example from a copy of the repository's client.

Needs go (DRAFTWISE_REQUIRE_GO=1 fails instead of skipping, as .ci/run sets)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GO_README = ROOT / "clients" / "go" / "README.md"
README_GOPATH = "/tmp/gopath"
"""The scratch GOPATH the README names; the test gives the commands a fresh one in its place."""


def _go() -> str:
    exe = shutil.which("go")
    if exe is None:
        message = "go is missing: apt-get install golang-go (see .ci/run); set DRAFTWISE_REQUIRE_GO=1 to fail instead"
        if os.environ.get("DRAFTWISE_REQUIRE_GO"):
            pytest.fail(message)
        pytest.skip(message)
    return exe


def go_build_commands() -> list[str]:
    """The commands of the README's GOPATH build block, continuation lines joined."""
    text = GO_README.read_text()
    section = text.split("## Build", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"\n\n((?: {4}.*\n)+)", section)
    assert m, "clients/go/README.md: no indented command block under ## Build"
    block = re.sub(r"\\\n\s*", "", m.group(1))
    return [line.strip() for line in block.splitlines() if line.strip()]


def ci_apt_packages() -> set[str]:
    run = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"apt-get install -y -qq ([^>&]+)", run)
    assert m, ".ci/run installs Debian packages"
    return set(m.group(1).split())


def test_go_readme_build_commands_run_as_written(tmp_path: Path) -> None:
    _go()
    commands = go_build_commands()
    assert commands[0].startswith("apt-get install "), commands
    # what the README installs, CI installs too (the apt line itself wants root and the network)
    assert set(commands[0].split()[2:]) <= ci_apt_packages(), commands[0]
    script = "\n".join(commands[1:])
    assert README_GOPATH in script and "go build" in script
    # a folder laid out like the repository root, holding what the commands read
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "clients" / "go", root / "clients" / "go")
    gopath = tmp_path / "gopath"
    env = {**os.environ, "GOFLAGS": "", "GOPROXY": "off", "CGO_ENABLED": "0"}  # offline: no module proxy
    env.setdefault("GOCACHE", str(Path(env.get("HOME", tmp_path)) / ".cache" / "go-build"))
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script.replace(README_GOPATH, str(gopath))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, f"{script}\n{res.stdout}{res.stderr}"
    binary = root / "draftwise-example"
    assert binary.is_file()
    # it runs: a bad flag is refused with status 2, nothing listening is status 1 with the server's error
    bad = subprocess.run([str(binary), "-max-tokens", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr
    down = subprocess.run(
        [str(binary), "-server", "127.0.0.1:1", "-timeout", "10s"], capture_output=True, text=True, timeout=60
    )
    assert down.returncode == 1 and "Unavailable" in down.stderr, down.stderr
