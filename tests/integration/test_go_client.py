"""The Go client (clients/go) against a live ``draftwise serve`` on 127.0.0.1: built with
Debian's Go toolchain in GOPATH mode (offline), its example streams one completion, resumes a
request whose call it dropped, and multiplexes three requests on one Generate stream,
cancelling one; the test parses its JSON output. Without ``go`` the tests skip, or fail when
DRAFTWISE_REQUIRE_GO=1 (as the CI command sets)."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.procs import CLIENT_DIR, ROOT, ServeProc
from tests.integration.tcp_proxy import TcpProxy

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import Client, Completion, SamplingParams  # noqa: E402

GO_DIR = ROOT / "clients" / "go"
MODULE = "github.com/draftwise/draftwise/clients/go"
DEBIAN_GOPATH = "/usr/share/gocode"
"""Where Debian's golang-*-dev packages put their sources (grpc, protobuf)."""
GO_MISSING = (
    "go is not on PATH: apt-get install golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc "
    "golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev; "
    "set DRAFTWISE_REQUIRE_GO=1 to fail instead"
)
MAX_TOKENS = 16
PROMPT = "def fibonacci(n):"
RECONNECT_TOKENS = 450
"""Several seconds of tokens: the request is surely still running (not all its tokens sent to the
paused client yet) when the connection is reset after 3 deltas, however fast the machine."""


def require(tool: str, env: str, missing: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        if os.environ.get(env):
            pytest.fail(missing)
        pytest.skip(missing)
    return exe


def go_env(gopath: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GO111MODULE="off", GOPATH=f"{gopath}{os.pathsep}{DEBIAN_GOPATH}", GOFLAGS="", GOPROXY="off", CGO_ENABLED="0"
    )
    if "GOCACHE" not in env and "HOME" not in env:  # (Go's default cache lives under $HOME)
        env["GOCACHE"] = str(gopath.parent / "gocache")
    return env


@pytest.fixture(scope="module")
def gopath(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], Path]:
    """clients/go copied into a GOPATH at its import path: (go, its environment, a work folder)."""
    go = require("go", "DRAFTWISE_REQUIRE_GO", GO_MISSING)
    tmp = tmp_path_factory.mktemp("go")
    shutil.copytree(GO_DIR, tmp / "gopath" / "src" / MODULE)
    return go, go_env(tmp / "gopath"), tmp


@pytest.fixture(scope="module")
def example(gopath: tuple[str, dict[str, str], Path]) -> Path:
    """The packages vetted, the example built."""
    go, env, tmp = gopath
    packages = [f"{MODULE}/draftwisev1", f"{MODULE}/draftwise", f"{MODULE}/cmd/draftwise-example"]
    vet = subprocess.run([go, "vet", *packages], env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
    assert vet.returncode == 0, vet.stdout + vet.stderr
    binary = tmp / "draftwise-example"
    build = subprocess.run(
        [go, "build", "-o", str(binary), packages[-1]], env=env, cwd=tmp, capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return binary


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    s = ServeProc(tmp_path_factory.mktemp("serve")).wait_listening()
    yield s
    s.close()


def run_example(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def parse(stdout: str) -> dict[str, dict[str, dict]]:
    """{scenario: {request id: result}} from the example's JSON lines."""
    out: dict[str, dict[str, dict]] = {}
    for line in stdout.splitlines():
        obj = json.loads(line)
        out[obj["scenario"]] = {r["id"]: r for r in obj["requests"]}
    return out


def assert_contiguous(r: dict) -> None:
    """Deltas start at token 0, each where the previous one ended, and add up to the tokens."""
    deltas = r["deltas"]
    assert deltas and deltas[0][0] == 0, r
    for (first, n), (nxt, _) in zip(deltas, deltas[1:], strict=False):
        assert nxt == first + n, f"gap or overlap in {deltas}"
    assert sum(n for _, n in deltas) == len(r["token_ids"]), r


def check_example_output(stdout: str, server: str, max_tokens: int = MAX_TOKENS) -> None:
    """What both examples (Go, TypeScript) must have printed against a live server."""
    got = parse(stdout)
    assert set(got) == {"stream", "resume", "multiplex", "request-error"}, stdout
    (streamed,) = got["stream"].values()
    (resumed,) = got["resume"].values()
    for r in (streamed, resumed):
        assert r["finish_reason"] == "FINISH_REASON_LENGTH" and not r.get("error"), r
        assert r["completion_tokens"] == len(r["token_ids"]) == max_tokens and r["prompt_tokens"] > 0, r
        assert r["resume_handle"], "the first delta carries a resume handle"
        assert_contiguous(r)
    # greedy: the request resumed after its call was dropped has exactly the undisturbed tokens
    assert resumed["token_ids"] == streamed["token_ids"] and resumed["text"] == streamed["text"]

    mux = got["multiplex"]
    assert set(mux) == {"a", "b", "long"}, mux
    a, b, long = mux["a"], mux["b"], mux["long"]
    for r, n in ((a, max_tokens), (b, max_tokens // 2)):
        assert r["finish_reason"] == "FINISH_REASON_LENGTH" and not r.get("error"), r
        assert r["completion_tokens"] == len(r["token_ids"]) == n, r
        assert_contiguous(r)
    assert a["token_ids"] == streamed["token_ids"], "the same greedy request on a bidi stream gives the same tokens"
    assert long["finish_reason"] == "FINISH_REASON_ABORT" and not long.get("error"), long
    assert long["prompt_tokens"] > 0 and 1 <= len(long["token_ids"]) <= long["completion_tokens"] < 400, long
    assert_contiguous(long)

    # a request the server refuses ends alone, with the server's code and message; its neighbour finishes
    bad, good = got["request-error"]["bad"], got["request-error"]["good"]
    assert "InvalidArgument" in bad["error"] and "top_p" in bad["error"] and not bad["finish_reason"], bad
    assert not bad["token_ids"], bad
    assert good["finish_reason"] == "FINISH_REASON_LENGTH" and good["completion_tokens"] == 4 and not good.get("error")
    assert_contiguous(good)

    # and what the Python client gets for the same request
    with Client(server) as client:
        py = client.complete(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert list(py.token_ids) == streamed["token_ids"] and py.text == streamed["text"]


def complete(address: str, params: SamplingParams) -> Completion:
    with Client(address) as client:
        return client.complete(PROMPT, params, timeout=120)


def check_reconnect(cmd: list[str], serve: ServeProc) -> None:
    """Run an example's reconnect scenario (flags in --name form, which Go's flag package takes
    too) through a TCP proxy that resets the connection after the third delta: the client
    resumes by itself and gets exactly the undisturbed tokens, indices contiguous from 0 (what
    the Python client gets for the same request, asked meanwhile straight from the server)."""
    pool = ThreadPoolExecutor(1)
    params = SamplingParams(max_tokens=RECONNECT_TOKENS, temperature=0, ignore_eos=True)
    undisturbed = pool.submit(complete, serve.address, params)
    pool.shutdown(wait=False)
    proxy = TcpProxy(serve.port)
    args = ["--server", proxy.address, "--json", "--pause-after", "3", "--max-tokens", str(RECONNECT_TOKENS)]
    proc = subprocess.Popen(
        [*cmd, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(60), "the example did not pause"
        assert json.loads(proc.stdout.readline()) == {"paused": True}
        assert proxy.drop() == 1, "one connection to reset"
        out, err = proc.communicate("\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proxy.close()
    assert proc.returncode == 0, err
    (line,) = out.splitlines()
    obj = json.loads(line)
    assert obj["scenario"] == "reconnect"
    (r,) = obj["requests"]
    assert r["resumes"] >= 1, f"the connection was reset but the client did not resume: {r}"
    assert r["finish_reason"] == "FINISH_REASON_LENGTH" and not r.get("error"), r
    assert r["completion_tokens"] == len(r["token_ids"]) == RECONNECT_TOKENS, r
    assert_contiguous(r)
    py = undisturbed.result(timeout=120)
    assert r["token_ids"] == list(py.token_ids) and r["text"] == py.text


def test_go_unit_tests(gopath: tuple[str, dict[str, str], Path]) -> None:
    """The wrapper's own tests (progress: replays dropped, gaps refused; transport errors;
    backoff; session ids; the per-request queue), with `go test`."""
    go, env, tmp = gopath
    res = subprocess.run(
        [go, "test", "-v", f"{MODULE}/draftwise"], env=env, cwd=tmp, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("--- PASS") >= 6 and "--- FAIL" not in res.stdout, res.stdout


def test_example_against_a_live_server(example: Path, serve: ServeProc) -> None:
    res = run_example([str(example), "-server", serve.address, "-json", "-max-tokens", str(MAX_TOKENS)])
    assert res.returncode == 0, res.stderr
    check_example_output(res.stdout, serve.address)


def test_stream_resumes_by_itself_after_a_reset_connection(example: Path, serve: ServeProc) -> None:
    check_reconnect([str(example)], serve)


def test_example_prints_text_without_json(example: Path, serve: ServeProc) -> None:
    res = run_example([str(example), "-server", serve.address, "-max-tokens", "4"])
    assert res.returncode == 0, res.stderr
    assert "== multiplex long: FINISH_REASON_ABORT" in res.stdout and "== stream " in res.stdout


def test_unknown_model_is_the_servers_message(example: Path, serve: ServeProc) -> None:
    res = run_example([str(example), "-server", serve.address, "-model", "nope"])
    assert res.returncode == 1
    assert "InvalidArgument" in res.stderr and "unknown model 'nope'" in res.stderr, res.stderr


def test_no_server_is_unavailable(example: Path) -> None:
    res = run_example([str(example), "-server", "127.0.0.1:1", "-timeout", "20s"])
    assert res.returncode == 1
    assert "Unavailable" in res.stderr, res.stderr


def test_bad_flag_is_refused(example: Path) -> None:
    res = run_example([str(example), "-max-tokens", "1"])
    assert res.returncode == 2 and "-max-tokens must be at least 2" in res.stderr, res.stderr
