"""Continuation (failover resubmission): a greedy request stopped after m tokens and resubmitted
with those tokens as its continuation goes on exactly as the undisturbed run: same tokens, and
the text released before the cut plus the text released after it is the undisturbed text, a
stop string straddling the cut included. Bad continuations are refused, touching nothing."""

from __future__ import annotations

import pytest

from draftwise.worker import LLM, SamplingParams
from draftwise.worker.core.outputs import SpecStats

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=8, speculative_method="ngram")


def _run(engine, rid, prompt, params, **kw):
    """(deltas, final output) of one request run alone."""
    engine.add_request(rid, prompt, params, **kw)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        out = engine.step()
        deltas += [d for d in out.deltas if d.request_id == rid]
        for o in out.finished:
            if o.request_id == rid:
                final = o
    return deltas, final


def _text_before(deltas, m):
    """Text the deltas released with tokens before index m (one token per greedy delta without speculation)."""
    return "".join(d.text for d in deltas if d.first_token_index + len(d.token_ids) <= m)


@pytest.mark.parametrize("cut", [1, 7, 15])
def test_continuation_equals_undisturbed(llm, cut):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, use_speculation=False)
    ref, ref_final = _run(engine, "ref", PROMPT, params)
    tokens = [t for d in ref for t in d.token_ids]
    assert len(tokens) == 24
    deltas, final = _run(engine, f"cont-{cut}", PROMPT, params, continuation=tokens[:cut])
    assert deltas[0].first_token_index == cut
    assert [t for d in deltas for t in d.token_ids] == tokens[cut:]
    assert _text_before(ref, cut) + "".join(d.text for d in deltas) == "".join(d.text for d in ref)
    c = final.outputs[0]
    assert c.token_ids == tokens and c.text == ref_final.outputs[0].text and c.finish_reason == "length"
    engine.check_idle_invariants()


def test_stop_string_straddling_the_cut(llm):
    """A stop string whose first characters came from tokens before the cut (their text held back)
    and whose end comes after it still stops the request, and no text is sent twice."""
    engine = llm.engine
    tok = llm.get_tokenizer()
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, use_speculation=False)
    ref, _ = _run(engine, "plain", PROMPT, plain)
    tokens = [t for d in ref for t in d.token_ids]
    # a stop string from the 2 last characters of token i's text to the first of token i+1's
    pieces = [tok.decode(tokens[: i + 1]) for i in range(len(tokens))]

    def straddling(i: int) -> str | None:
        if len(pieces[i]) - len(pieces[i - 1]) < 2 or len(pieces[i + 1]) <= len(pieces[i]):
            return None
        stop = pieces[i + 1][len(pieces[i]) - 2 : len(pieces[i]) + 1]
        return None if stop in pieces[i] or not stop.strip() else stop

    i = next(i for i in range(4, 38) if straddling(i))
    stop = straddling(i)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, use_speculation=False, stop=[stop])
    sref, sref_final = _run(engine, "stop-ref", PROMPT, params)
    stokens = [t for d in sref for t in d.token_ids]
    assert sref_final.outputs[0].stop_reason == stop
    cut = i + 1  # tokens[:i+1] hold the stop string's start, held back, unsent
    deltas, final = _run(engine, "stop-cont", PROMPT, params, continuation=stokens[:cut])
    assert [t for d in deltas for t in d.token_ids] == stokens[cut:]
    assert _text_before(sref, cut) + "".join(d.text for d in deltas) == sref_final.outputs[0].text
    assert final.outputs[0].stop_reason == stop and final.outputs[0].finish_reason == "stop"


def test_usage_and_speculation_counters_cover_the_continuation(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref, ref_final = _run(engine, "spec-ref", PROMPT, params)
    tokens = ref_final.outputs[0].token_ids
    earlier = SpecStats(proposed=11, accepted=7, verify_steps=5)
    deltas, final = _run(engine, "spec-cont", PROMPT, params, continuation=tokens[:10], continuation_spec=earlier)
    c = final.outputs[0]
    assert c.token_ids == tokens and len(c.token_ids) == 30
    assert deltas[0].first_token_index == 10
    assert deltas[0].num_prompt_tokens is None  # the first delta of the original run reported it
    assert c.spec is not None and c.spec.proposed >= 11 and c.spec.accepted >= 7 and c.spec.verify_steps >= 5
    assert deltas[0].spec.proposed >= 11


@pytest.mark.parametrize(
    ("continuation", "params", "message"),
    [
        ([5, -1], {}, "continuation token ids must be integers"),
        ([5, 10**9], {}, "continuation token ids must be integers"),
        (list(range(5, 13)), {"max_tokens": 8}, "reach max_tokens=8"),
        ([5] * 250, {}, "must be shorter than max_model_len=256"),
        ([5, 6], {"stop_token_ids": [6]}, "is a stop token id"),
        (["eos"], {}, "is EOS"),
    ],
)
def test_bad_continuation_refused(llm, continuation, params, message):
    engine = llm.engine
    continuation = [engine.eos_token_ids[0] if t == "eos" else t for t in continuation]
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", PROMPT, SamplingParams(temperature=0, **params), continuation=continuation)
    assert "bad" not in engine.requests
    engine.check_idle_invariants()


def test_continuation_with_stop_string_already_matched_refused(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, use_speculation=False)
    ref, ref_final = _run(engine, "sref", PROMPT, params)
    text = ref_final.outputs[0].text
    start = next(i for i in range(len(text)) if not text[i].isspace())
    stop = text[start : start + 4]
    assert stop.strip() and len(stop) == 4
    with pytest.raises(ValueError, match="already finished: its text contains the stop string"):
        engine.add_request(
            "bad",
            PROMPT,
            SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
            continuation=ref_final.outputs[0].token_ids[:15],
        )
    assert "bad" not in engine.requests
