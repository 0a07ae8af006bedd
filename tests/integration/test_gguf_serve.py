"""A GGUF file served for real: ``draftwise serve --model x.gguf`` streams completions (plain
text and a chat-formatted prompt rendered with the file's own template) equal to the offline
engine's greedy output on the same file, a chat reply ending at the template's end-of-turn token; ``draftwise generate --model x.gguf`` prints the same;
a GGUF path that does not exist is one line and exit 2 (generate), a file that is no GGUF a worker
given up with the reason (serve)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker import LLM, SamplingParams
from tests.integration.conftest import reference_outputs
from tests.integration.procs import ServeProc, child_env
from tests.integration.rpc import run_stream, start
from tests.model.smollm2 import require_smollm2

pytestmark = pytest.mark.slow  # a real 135M-parameter model, loaded three times

MAX_TOKENS = 12
PLAIN = "The capital of France is"
ENGINE = {"max_model_len": 512, "num_kv_blocks": 64, "max_num_seqs": 64}
"""The served workers' settings (ServeProc's flags, with a smaller KV cache)."""


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return require_smollm2()


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> tuple[list[str], list]:
    llm = LLM(model=str(smollm2), **ENGINE)
    tok = llm.get_tokenizer()
    assert tok is not None
    chat = tok.hf.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    texts = [PLAIN, chat]
    outs = reference_outputs(llm, texts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return texts, [o.outputs[0] for o in outs]


def test_serve_streams_a_gguf_model(tmp_path: Path, smollm2: Path, reference) -> None:
    texts, refs = reference
    serve = ServeProc(tmp_path, f"--model={smollm2}", f"--num-kv-blocks={ENGINE['num_kv_blocks']}")
    try:
        serve.wait_listening()
        assert serve.model == smollm2.name

        async def main() -> dict:
            async with grpc.aio.insecure_channel(serve.address) as ch:
                stub = gsgrpc.GenerateServiceStub(ch)
                starts = [start(f"r{i}", t, temperature=0, max_tokens=MAX_TOKENS) for i, t in enumerate(texts)]
                # long enough for the reply to end: the template's end-of-turn token stops it
                starts.append(start("chat", texts[1], temperature=0, max_tokens=64))
                return await run_stream(stub, starts)

        results = asyncio.run(main())
        for i, ref in enumerate(refs):
            r = results[f"r{i}"]
            assert r.kind == "finished", r.final
            assert r.token_ids == list(ref.token_ids) and r.text == ref.text, (texts[i], r.text, ref.text)
            assert len(r.delta_sizes) > 1  # streamed, not one final blob
        chat = results["chat"]
        assert chat.finish_reason == pb.FINISH_REASON_STOP and "Paris" in chat.text, chat
        assert "<|im_end|>" not in chat.text and chat.token_ids[: len(refs[1].token_ids)] == list(refs[1].token_ids)

        res = subprocess.run(
            [sys.executable, "-m", "draftwise.cli", "generate", PLAIN, f"--max-tokens={MAX_TOKENS}"]
            + [f"--server={serve.address}", "--wait=30"],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout == PLAIN + refs[0].text + "\n"
    finally:
        serve.close()


def test_generate_in_process_from_a_gguf(smollm2: Path, reference) -> None:
    _, refs = reference
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", PLAIN, f"--max-tokens={MAX_TOKENS}", f"--model={smollm2}"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == PLAIN + refs[0].text + "\n"


def test_missing_gguf_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", "hi", f"--model={missing}"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == f"error: {missing}: GGUF file does not exist\n"

    # a file that exists but is no GGUF: the worker refuses it, serve gives it up and says why
    foreign = tmp_path / "foreign.gguf"
    foreign.write_text("not a model")
    serve = ServeProc(tmp_path, f"--model={foreign}")
    try:
        assert serve.popen.wait(180) == 1
    finally:
        serve.close()
    log = serve.log()
    assert "while starting; not restarting it" in log, log[-3000:]
    assert f"{foreign}: not a GGUF file (it does not start with the GGUF magic bytes)" in log, log[-3000:]
