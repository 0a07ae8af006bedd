"""A request's first delta carries its prompt token count and queue time (the engine's
``RequestDelta.num_prompt_tokens``/``queue_time``, sent as ``TokenDelta.prompt_tokens``/
``queue_ms``), so that the gateway can report them for a request it cancels; later deltas
never do."""

from __future__ import annotations

import pytest

from draftwise.worker import SamplingParams
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.serving.proto_convert import responses_from_delta


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=128, num_kv_blocks=16))


def test_first_delta_carries_prompt_tokens_and_queue_time(engine):
    req = engine.add_request("r", [1, 536, 887, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step().deltas)
    first, *later = deltas
    assert first.first_token_index == 0 and first.num_prompt_tokens == 4
    assert first.queue_time == pytest.approx(req.first_scheduled_time - req.arrival_time)
    assert later and all(d.num_prompt_tokens is None and d.queue_time is None for d in later)
    msg = responses_from_delta(first)[0].event.delta
    assert msg.prompt_tokens == 4 and msg.queue_ms == pytest.approx(first.queue_time * 1000)
    for d in later:
        for resp in responses_from_delta(d):
            if resp.event.WhichOneof("kind") == "delta":
                assert resp.event.delta.prompt_tokens == 0 and resp.event.delta.queue_ms == 0
