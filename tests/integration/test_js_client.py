"""The TypeScript client (clients/js) against a live ``draftwise serve`` on 127.0.0.1: compiled
with the package's own TypeScript (``npm ci`` in clients/js installs it), its example streams
one completion, resumes a request whose call it dropped, and multiplexes three requests on one
Generate stream, cancelling one; the checks are the Go example's. Without node or the installed
packages the tests skip, or fail when DRAFTWISE_REQUIRE_NODE=1 (as the CI command sets)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.integration.procs import ROOT, ServeProc
from tests.integration.test_go_client import MAX_TOKENS, check_example_output, check_reconnect, run_example

JS_DIR = ROOT / "clients" / "js"
NODE_MISSING = "node is not on PATH (Node.js >= 20); set DRAFTWISE_REQUIRE_NODE=1 to fail instead"
NPM_MISSING = (
    "clients/js/node_modules is missing: run `npm ci` in clients/js; set DRAFTWISE_REQUIRE_NODE=1 to fail instead"
)


def _fail_or_skip(message: str) -> None:
    if os.environ.get("DRAFTWISE_REQUIRE_NODE"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def example() -> list[str]:
    """The package compiled (tsc, strict) into clients/js/dist; the command that runs its example."""
    node = shutil.which("node")
    if node is None:
        _fail_or_skip(NODE_MISSING)
    tsc = JS_DIR / "node_modules" / ".bin" / "tsc"
    if not tsc.exists():
        _fail_or_skip(NPM_MISSING)
    shutil.rmtree(JS_DIR / "dist", ignore_errors=True)
    build = subprocess.run([str(tsc), "-p", "tsconfig.json"], cwd=JS_DIR, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    assert (JS_DIR / "dist" / "index.d.ts").is_file()
    return [str(node), str(JS_DIR / "dist" / "example.js")]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    s = ServeProc(tmp_path_factory.mktemp("serve")).wait_listening()
    yield s
    s.close()


def test_example_against_a_live_server(example: list[str], serve: ServeProc) -> None:
    res = run_example([*example, "--server", serve.address, "--json", "--max-tokens", str(MAX_TOKENS)])
    assert res.returncode == 0, res.stderr
    check_example_output(res.stdout, serve.address)


def test_stream_resumes_by_itself_after_a_reset_connection(example: list[str], serve: ServeProc) -> None:
    check_reconnect(example, serve)


def test_example_prints_text_without_json(example: list[str], serve: ServeProc) -> None:
    res = run_example([*example, "--server", serve.address, "--max-tokens", "4"])
    assert res.returncode == 0, res.stderr
    assert "== multiplex long: FINISH_REASON_ABORT" in res.stdout and "== stream " in res.stdout


def test_unknown_model_is_the_servers_message(example: list[str], serve: ServeProc) -> None:
    res = run_example([*example, "--server", serve.address, "--model", "nope"])
    assert res.returncode == 1
    assert "InvalidArgument" in res.stderr and "unknown model 'nope'" in res.stderr, res.stderr


def test_no_server_is_unavailable(example: list[str]) -> None:
    res = run_example([*example, "--server", "127.0.0.1:1"])
    assert res.returncode == 1
    assert "Unavailable" in res.stderr, res.stderr


def test_bad_flag_is_refused(example: list[str]) -> None:
    res = run_example([*example, "--max-tokens", "1"])
    assert res.returncode == 2 and "--max-tokens must be an integer of at least 2" in res.stderr, res.stderr


def test_lockfile_pins_what_is_installed() -> None:
    """`npm ci` installs exactly package-lock.json, which agrees with package.json."""
    pkg = json.loads((JS_DIR / "package.json").read_text())
    lock = json.loads((JS_DIR / "package-lock.json").read_text())
    root = lock["packages"][""]
    assert root["dependencies"] == pkg["dependencies"] and root["devDependencies"] == pkg["devDependencies"]
    for name, version in {**pkg["dependencies"], **pkg["devDependencies"]}.items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version, name


def test_readme_snippet_runs(example: list[str], serve: ServeProc) -> None:
    """The TypeScript block of clients/js/README.md (plain JavaScript as written) runs against the server."""
    (code,) = re.findall(r"^```ts\n(.*?)^```", (JS_DIR / "README.md").read_text(), flags=re.S | re.M)
    code = code.replace('"@draftwise/client"', '"./index.js"').replace("127.0.0.1:50051", serve.address)
    script = JS_DIR / "dist" / "readme_snippet.mjs"
    script.write_text(code)
    res = run_example([example[0], str(script)], timeout=120)
    assert res.returncode == 0, res.stderr
    # the streamed text, then its finish reason by name (not the enum's number) and completion tokens
    assert re.search(r"(STOP|LENGTH) \d+$", res.stdout.rstrip()), res.stdout


UNIT_SCRIPT = """
import { create } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import { GenerationEventSchema } from "./index.js";
import { Client, DraftwiseError, isTransportError } from "./index.js";
import { Progress } from "./errors.js";
import { AsyncQueue } from "./queue.js";

const delta = (first, ids, handle = "") =>
  create(GenerationEventSchema, { requestId: "r", kind: { case: "delta", value: { firstTokenIndex: first, tokenIds: ids, resumeHandle: handle } } });
const finished = () => create(GenerationEventSchema, { requestId: "r", kind: { case: "finished", value: { finishReason: 2 } } });
const out = {};
const p = new Progress("r");
out.kept = [p.accept(delta(0, [1, 2], "h")), p.accept(delta(2, [3])), p.accept(delta(2, [3])), p.accept(finished()), p.accept(finished())];
out.handle = p.handle;
out.next = p.nextIndex;
try { new Progress("r").accept(delta(1, [7])); } catch (e) { out.gap = [e instanceof DraftwiseError, e.code === Code.DataLoss, e.message]; }
out.transport = [
  isTransportError(new DraftwiseError(Code.Unavailable, "connect ECONNREFUSED")),
  isTransportError(new DraftwiseError(Code.Aborted, "read ECONNRESET")),
  isTransportError(new DraftwiseError(Code.Aborted, "resumed on another connection")),
  isTransportError(new DraftwiseError(Code.InvalidArgument, "top_p must be in (0, 1]")),
  isTransportError(new DraftwiseError(Code.Canceled, "http/2 stream closed with error code CANCEL (0x8)")),
  isTransportError(new DraftwiseError(Code.Canceled, "This operation was aborted")),
];
const client = new Client("127.0.0.1:1"); // nothing listens: the session's call fails, its checks come first
const session = client.session();
try { session.start({ id: "" , prompt: { kind: { case: "text", value: "x" } } }); } catch (e) { out.noId = e.message; }
session.closeSend();
try { session.start({ id: "late", prompt: { kind: { case: "text", value: "x" } } }); } catch (e) { out.late = e.message; }
await session.done.catch((e) => { out.done = e.message; });
client.close();
const q = new AsyncQueue();
for (let i = 0; i < 1000; i++) q.push(i);
q.close();
let n = 0, inOrder = true;
for await (const x of q) { inOrder &&= x === n; n++; }
out.queue = [n, inOrder];
console.log(JSON.stringify(out));
"""


def test_wrapper_units(example: list[str]) -> None:
    """Progress (replays dropped, a gap is DATA_LOSS), transport errors, the queue, on the compiled package."""
    script = JS_DIR / "dist" / "units_check.mjs"
    script.write_text(UNIT_SCRIPT)
    res = run_example([example[0], str(script)], timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["kept"] == [True, True, False, True, False] and (out["handle"], out["next"]) == ("h", 3)
    assert out["gap"] == [True, True, "request r: DataLoss: delta at token 1 (+1) after 0 tokens received"]
    assert out["transport"] == [True, True, False, False, True, False]  # a reset session's CANCEL resumes
    assert out["queue"] == [1000, True]
    assert out["noId"] == "InvalidArgument: a session request needs an id"
    assert out["late"] in (
        "request late: FailedPrecondition: closeSend() was called: no new requests",
        "request late: FailedPrecondition: the session has ended: closed",
    )
    assert out["done"].startswith("Unavailable: "), out["done"]
