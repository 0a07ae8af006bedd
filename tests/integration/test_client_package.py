"""The Python client (clients/python, ``draftwise_client``): vendored stubs up to date,
installable and importable without torch or the server package, its async and sync APIs
against the real gateway, and its examples."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from draftwise.worker import SamplingParams as EngineParams
from tests.integration.conftest import reference_outputs
from tests.integration.procs import CLIENT_DIR, MODEL_NAME, child_env

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import AsyncClient, Client, GenerationError, SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\n\ndef list_files(path):"]


def test_vendored_stubs_are_up_to_date():
    res = subprocess.run(
        [sys.executable, str(CLIENT_DIR / "gen_stubs.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_installs_and_imports_without_torch(tmp_path):
    src = tmp_path / "src"  # build a copy: nothing lands in the checkout
    shutil.copytree(CLIENT_DIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*"))
    target = tmp_path / "site"
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            *isolation,
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (meta,) = target.glob("draftwise_client-*.dist-info/METADATA")
    requires = sorted(line.split()[1] for line in meta.read_text().splitlines() if line.startswith("Requires-Dist:"))
    assert [r.split(">")[0].split("<")[0].split("=")[0] for r in requires] == ["grpcio", "protobuf"], requires
    code = (
        "import sys; import draftwise_client as c; "
        "assert c.__file__.startswith(sys.argv[1]), c.__file__; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'draftwise', 'transformers')]; "
        "assert not bad, bad; print('ok')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        env=child_env(PYTHONPATH=str(target)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.fixture(scope="module")
def reference(reference_llm):
    outs = reference_outputs(reference_llm, PROMPTS, EngineParams(temperature=0, max_tokens=20))
    return [o.outputs[0].text for o in outs]


def test_sync_client(gateway, reference):
    with Client(gateway.address) as client:
        client.wait_ready(timeout=10)
        assert [m.name for m in client.list_models()] == [MODEL_NAME]
        deltas = list(client.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0)))
        assert "".join(d.text for d in deltas) == reference[0]
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 20
        assert client.complete(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0)).text == reference[1]
        with pytest.raises(GenerationError) as e:
            client.complete(PROMPTS[0], SamplingParams(temperature=-1))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.message


def test_async_client_and_session(gateway, reference):
    async def main():
        async with AsyncClient(gateway.address) as client:
            await client.wait_ready(timeout=10)
            text = "".join(
                [d.text async for d in client.generate(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0))]
            )
            async with client.session() as s:
                streams = [await s.generate(p, SamplingParams(max_tokens=20, temperature=0)) for p in PROMPTS]
                long = await s.generate("x", SamplingParams(max_tokens=400, ignore_eos=True))
                bad = await s.generate("x", SamplingParams(top_p=2.0))
                await anext(long)
                await long.cancel()
                long_last = [d async for d in long][-1]
                with pytest.raises(GenerationError) as bad_error:
                    await bad.complete()
                completions = await asyncio.gather(*(st.complete() for st in streams))
            return text, completions, long_last, bad_error.value

    text, completions, long_last, bad_error = asyncio.run(main())
    assert text == reference[2]
    assert [c.text for c in completions] == reference
    assert long_last.finish_reason == "abort"
    assert bad_error.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad_error.message


def test_sync_session(gateway, reference):
    """The blocking client's session: the same semantics as the async one (many requests on one
    stream, each with its own deltas, cancellable, one bad request failing alone), its requests
    read from several threads at once."""
    with Client(gateway.address) as client, client.session(timeout=60) as s:
        streams = [s.generate(p, SamplingParams(max_tokens=20, temperature=0)) for p in PROMPTS]
        long = s.generate("x", SamplingParams(max_tokens=400, ignore_eos=True))
        bad = s.generate("x", SamplingParams(top_p=2.0))
        first = next(long)
        long.cancel()
        long_last = [first, *long][-1]
        with pytest.raises(GenerationError) as bad_error:
            bad.complete()
        with ThreadPoolExecutor(len(streams)) as pool:
            completions = list(pool.map(lambda st: st.complete(), streams))
        assert [st.attempts for st in streams] == [1] * len(PROMPTS) and s.reconnects == 0
    assert [c.text for c in completions] == reference
    assert [c.request_id for c in completions] == [st.request_id for st in streams]
    assert long_last.finish_reason == "abort"
    assert bad_error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad_error.value.message
    with pytest.raises(RuntimeError):
        s.generate("x")  # the session is closed


@pytest.mark.parametrize("example", ["stream.py", "async_stream.py", "multiplex.py", "session.py"])
def test_examples_run(gateway, example):
    """Each example takes a prompt (the session examples one or more)."""
    args = [sys.executable, str(CLIENT_DIR / "examples" / example), f"--server={gateway.address}"]
    args += ["def fibonacci(n):", "--max-tokens=8"]
    res = subprocess.run(
        args, env=child_env(PYTHONPATH=str(CLIENT_DIR)), capture_output=True, text=True, timeout=120, cwd=Path.cwd()
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "def fibonacci(n):" in res.stdout
