"""prompt + max_tokens beyond max_model_len is refused, naming both numbers (issue 23: it used to
be capped silently, so a client asking for 2**31 tokens ran until the context was full); exactly
the context is accepted, and a failover's continuation keeps its budget: the tokens it already
generated are part of max_tokens, not added to it."""

from __future__ import annotations

import pytest

from draftwise.worker import LLM, SamplingParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=32, max_num_seqs=4)


def _drain(engine, rid):
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            if o.request_id == rid:
                final = o
    return final


@pytest.mark.parametrize("extra", [1, 2**31 - MAX_MODEL_LEN])
def test_max_tokens_beyond_the_context_is_refused(llm, extra):
    prompt = list(range(5, 15))  # 10 tokens
    max_tokens = MAX_MODEL_LEN - len(prompt) + extra
    with pytest.raises(ValueError, match=r"max_tokens=\d+ is too large") as e:
        llm.engine.add_request("big", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    msg = str(e.value)
    assert (
        f"max_tokens={max_tokens}" in msg and "prompt is 10 tokens" in msg and f"max_model_len={MAX_MODEL_LEN}" in msg
    )
    assert not llm.engine.has_unfinished_requests()


def test_exactly_the_context_is_accepted_and_a_continuation_keeps_its_budget(llm):
    engine = llm.engine
    prompt = list(range(5, 15))
    room = MAX_MODEL_LEN - len(prompt)
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    engine.add_request("full", prompt, params)
    full = _drain(engine, "full")
    tokens = full.outputs[0].token_ids
    assert len(tokens) == room and full.outputs[0].finish_reason == "length"
    # resubmitted after 20 tokens (a failover): same prompt and max_tokens, the rest comes
    engine.add_request("cont", prompt, params, continuation=tokens[:20])
    cont = _drain(engine, "cont")
    assert cont.outputs[0].token_ids == tokens
