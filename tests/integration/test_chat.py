"""Chat over the wire: a real worker serving a model with a chat template (the embedded target
with a ChatML template, see tests/chat_model.py) behind a real gateway; raw gRPC, the Python
client (sync and async) and ``draftwise chat`` through a pipe and a terminal, each equal to the
offline ``LLM.chat``; and the INVALID_ARGUMENT of every conversation that cannot run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker import LLM
from draftwise.worker import SamplingParams as EngineParams
from tests.chat_model import chat_doc_blocks, make_chat_model
from tests.integration.procs import (
    CLIENT_DIR,
    ENGINE_ARGS,
    ENGINE_KWARGS,
    PARENT,
    ROOT,
    Proc,
    child_env,
    secret_args,
)
from tests.integration.procs import start_gateway as start_gateway_proc

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import AsyncClient, Client, GenerationError, SamplingParams  # noqa: E402

CONV = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat-model") / "chatml")


@pytest.fixture(scope="module")
def chat_gateway(chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("chat-procs")
    args = [
        "-m",
        "draftwise.worker.serving.server",
        "--port=0",
        "--log-format=json",
        *PARENT,
        *secret_args(),
        *ENGINE_ARGS,
    ]
    worker = Proc("chat-worker", [*args, f"--model={chat_dir}"], tmp).wait_ready()
    try:
        gateway = start_gateway_proc([worker], tmp, "chat-gateway", "--resume-retention-s=0")
    except BaseException:
        worker.kill()
        raise
    yield gateway
    gateway.stop()
    worker.stop()


@pytest.fixture(scope="module")
def chat_llm(chat_dir: Path) -> Iterator[LLM]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker: the same kernels, the same greedy tokens
    try:
        yield LLM(chat_dir, **ENGINE_KWARGS)
    finally:
        torch.set_num_threads(threads)


def reply(llm: LLM, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> str:
    (out,) = llm.chat(messages, EngineParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return out.outputs[0].text


def chat_start(messages: list[tuple[str, str]], **params: object) -> gspb.GenerateStreamRequest:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])
    start = pb.StartGeneration(prompt=pb.Prompt(chat=chat), sampling_params=pb.SamplingParams(**params))
    return gspb.GenerateStreamRequest(start=start)


async def stream(address: str, req: gspb.GenerateStreamRequest) -> tuple[str, list[int], pb.Finished]:
    async with grpc.aio.insecure_channel(address) as ch:
        text, ids, fin = "", [], None
        async for resp in gsgrpc.GenerateServiceStub(ch).GenerateStream(req, timeout=60):
            ev = resp.event
            if ev.WhichOneof("kind") == "delta":
                text += ev.delta.text
                ids.extend(ev.delta.token_ids)
            else:
                fin = ev.finished
        assert fin is not None
        return text, ids, fin


def test_chat_over_grpc_equals_llm_chat(chat_gateway: Proc, chat_llm: LLM) -> None:
    (ref,) = chat_llm.chat(CONV, EngineParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    req = chat_start([(m["role"], m["content"]) for m in CONV], temperature=0, max_tokens=MAX_TOKENS)
    text, ids, fin = asyncio.run(stream(chat_gateway.address, req))
    assert ids == ref.outputs[0].token_ids
    assert text == ref.outputs[0].text
    assert fin.usage.prompt_tokens == len(ref.prompt_token_ids)  # the rendered template, counted by the worker
    assert fin.finish_reason == pb.FINISH_REASON_LENGTH


def test_python_client_chat_sync_and_async(chat_gateway: Proc, chat_llm: LLM) -> None:
    want = reply(chat_llm, CONV)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with Client(chat_gateway.address) as client:
        deltas = list(client.chat(CONV, params))
    assert "".join(d.text for d in deltas) == want
    assert deltas[-1].finish_reason == "length"

    async def run() -> str:
        async with AsyncClient(chat_gateway.address) as client:
            return "".join([d.text async for d in client.chat(CONV, params)])

    assert asyncio.run(run()) == want
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"), Client(chat_gateway.address) as client:
        client.chat(["hello"], params)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "prompt.chat has no messages"),
        ([("", "hi")], r"prompt.chat.messages\[0\].role is empty"),
        ([("user", "def f(x):\n" * 400)], "render to a prompt of .* tokens; it must be shorter than max_model_len=512"),
    ],
)
def test_bad_chats_are_invalid_argument(chat_gateway: Proc, messages: list, match: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(stream(chat_gateway.address, chat_start(messages, max_tokens=4)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() is not None
    import re

    assert re.search(match, err.value.details()), err.value.details()


def test_model_without_chat_template_is_invalid_argument(gateway: Proc) -> None:
    # the shared gateway serves the embedded default model, which has no chat template
    with pytest.raises(GenerationError) as err, Client(gateway.address) as client:
        list(client.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "this model has no chat template" in err.value.message


def chat_cmd(address: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "draftwise.cli", "chat", "--server", address, "--max-tokens", str(MAX_TOKENS), *flags]


def test_chat_command_through_a_pipe_keeps_the_history(chat_gateway: Proc, chat_llm: LLM, tmp_path: Path) -> None:
    turns = ["def fibonacci(n):", "class Stack:"]
    system = "You write Python."
    res = subprocess.run(
        chat_cmd(chat_gateway.address, "--system", system, "--wait", "30"),
        input="\n".join(turns) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    history = [{"role": "system", "content": system}]
    want = ""
    for t in turns:
        history.append({"role": "user", "content": t})
        r = reply(chat_llm, history)
        history.append({"role": "assistant", "content": r})
        want += r + "\n"
    assert res.stdout == want
    assert "Traceback" not in res.stderr


def test_chat_command_reports_a_refusal_and_exits_1(gateway: Proc, tmp_path: Path) -> None:
    res = subprocess.run(
        chat_cmd(gateway.address),
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=tmp_path,
    )
    assert res.returncode == 1
    assert "error: INVALID_ARGUMENT: this model has no chat template" in res.stderr
    assert "Traceback" not in res.stderr


def _as_from_a_shell() -> None:
    """In a child before exec: SIGINT handled by default and nothing blocked, as an interactive
    shell starts a program. A test run started in the background (``cmd &`` in a script)
    ignores SIGINT, and an ignored signal stays ignored across exec: the chat would then
    rightly ignore Ctrl-C (Python installs its KeyboardInterrupt handler only over SIG_DFL)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _chat_from_a_shell(cmd: list[str], cwd: Path) -> subprocess.Popen[str]:
    """The chat command with pipes for stdin, stdout and stderr, started as a shell would."""
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=cwd,
        preexec_fn=_as_from_a_shell,
    )


def test_chat_command_ctrl_c_while_waiting_for_input_exits_0(chat_gateway: Proc, chat_llm: LLM, tmp_path: Path) -> None:
    want = reply(chat_llm, [{"role": "user", "content": "def f():"}]) + "\n"
    p = _chat_from_a_shell(chat_cmd(chat_gateway.address), tmp_path)
    assert p.stdin is not None
    p.stdin.write("def f():\n")
    p.stdin.flush()
    assert p.stdout is not None
    first = p.stdout.read(len(want))  # the first reply is out: it now waits on stdin
    p.send_signal(signal.SIGINT)
    p.wait(timeout=30)  # stdin still open: only the SIGINT can have ended it
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert first == want
    assert "Traceback" not in err


def test_chat_command_ctrl_c_while_waiting_for_the_server_exits_at_once(tmp_path: Path) -> None:
    """``--wait`` polls the server's health with SIGINT blocked in the main thread (it must be,
    before gRPC starts its threads): a Ctrl-C then waited for the whole ``--wait``. The poll
    lets SIGINT in, so the chat ends at once. The "server" here accepts connections and never
    answers, so the chat is known to be inside the poll when the signal comes."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        srv.settimeout(60)
        p = _chat_from_a_shell(chat_cmd(f"127.0.0.1:{srv.getsockname()[1]}", "--wait", "120"), tmp_path)
        conn, _ = srv.accept()  # the first health check is in flight
        with conn:
            time.sleep(0.5)
            t0 = time.monotonic()
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=30)
            took = time.monotonic() - t0
    assert p.returncode == 0, err
    assert took < 10, f"Ctrl-C took {took:.1f} s to end the wait"
    assert "Traceback" not in err


def _read_until(fd: int, needle: bytes, timeout: float = 60.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while needle not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {buf!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


@contextlib.contextmanager
def _chat_on_a_terminal(address: str, tmp_path: Path) -> Iterator[tuple[int, int, bytes]]:
    """``draftwise chat`` in a child process on a pseudo-terminal: (pid, the terminal's fd),
    past its first reply to ``def fibonacci(n):`` (yielded with the output of that turn as
    the third item); killed and reaped on the way out."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: draftwise chat on a terminal
        os.chdir(tmp_path)
        _as_from_a_shell()
        os.execve(sys.executable, chat_cmd(address), child_env())
    try:
        _read_until(fd, b">>> ")
        os.write(fd, b"def fibonacci(n):\n")
        yield pid, fd, _read_until(fd, b">>> ")  # the reply, then the next prompt
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def _ends_cleanly(pid: int, fd: int) -> None:
    rest = _read_until(fd, b"\n", timeout=30)
    assert b"Traceback" not in rest
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("key", [b"\x04", b"\x03"], ids=["ctrl-d", "ctrl-c"])
def test_chat_command_in_a_terminal_streams_and_ends_on_ctrl_d_or_ctrl_c(
    key: bytes, chat_gateway: Proc, chat_llm: LLM, tmp_path: Path
) -> None:
    with _chat_on_a_terminal(chat_gateway.address, tmp_path) as (pid, fd, out):
        want = reply(chat_llm, [{"role": "user", "content": "def fibonacci(n):"}])
        assert want.replace("\n", "\r\n").encode() in out
        os.write(fd, key)  # Ctrl-D (end of input) or Ctrl-C (SIGINT from the terminal)
        _ends_cleanly(pid, fd)


def _sigint_blocked(pid: int, tid: int) -> bool:
    """Whether thread ``tid`` of ``pid`` blocks SIGINT (its SigBlk mask, /proc)."""
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
def test_chat_leaves_sigint_to_its_main_thread(chat_gateway: Proc, tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to the process, and the kernel hands it to any thread that does
    not block it; Python only acts on it in the main thread. So at the prompt, after a reply
    (gRPC's threads are all up), every thread but the main one blocks SIGINT and the main one
    does not: Ctrl-C always wakes the prompt (it once did nothing when a gRPC thread took it)."""
    with _chat_on_a_terminal(chat_gateway.address, tmp_path) as (pid, fd, _):  # a reply streamed: gRPC's threads exist
        time.sleep(0.2)  # the main thread is back in the prompt's select()
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        assert len(tids) > 1, "gRPC started no thread: nothing to check"
        assert not _sigint_blocked(pid, pid), "the main thread blocks SIGINT at the prompt"
        assert [t for t in tids if t != pid and not _sigint_blocked(pid, t)] == [], "threads that could take Ctrl-C"
        st = Path(f"/proc/{pid}/status").read_text()
        print(
            "DIAG child",
            [x for x in st.splitlines() if x.startswith(("SigIgn", "SigCgt", "SigBlk", "SigPnd", "ShdPnd"))],
        )
        me = Path("/proc/self/status").read_text()
        print(
            "DIAG pytest",
            [x for x in me.splitlines() if x.startswith(("SigIgn", "SigCgt", "SigBlk"))],
            signal.getsignal(signal.SIGINT),
        )
        os.kill(pid, signal.SIGINT)  # what the terminal sends: the session ends at once
        _ends_cleanly(pid, fd)


def _run_snippet(code: str, tmp_path: Path) -> str:
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=child_env(PYTHONPATH=str(CLIENT_DIR)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stdout.strip()
    return res.stdout


def test_doc_chat_snippets_run(chat_gateway: Proc, chat_dir: Path, tmp_path: Path) -> None:
    (llm_block,) = chat_doc_blocks(ROOT / "docs" / "serving.md")
    assert "path/to/instruct-model" in llm_block
    _run_snippet(llm_block.replace("path/to/instruct-model", str(chat_dir)), tmp_path)
    (client_block,) = chat_doc_blocks(ROOT / "clients" / "python" / "README.md")
    assert "127.0.0.1:50051" in client_block
    _run_snippet(client_block.replace("127.0.0.1:50051", chat_gateway.address), tmp_path)
