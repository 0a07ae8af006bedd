"""Continuation (failover resubmission): a greedy request stopped after m tokens and resubmitted
with those tokens as its continuation goes on exactly as the undisturbed run: same tokens, and
the text released before the cut plus the text released after it is the undisturbed text, a
stop string straddling the cut included. Bad continuations are refused, touching nothing."""

from __future__ import annotations

import pytest

from draftwise.worker import LLM, SamplingParams
from draftwise.worker.core.outputs import SpecStats
from draftwise.worker.core.request import FinishedContinuation

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
    ("continuation", "params", "message", "finished"),
    [
        ([5, -1], {}, "continuation token ids must be integers", None),
        ([5, 10**9], {}, "continuation token ids must be integers", None),
        (list(range(5, 13)), {"max_tokens": 8}, "reach max_tokens=8", "length"),
        (list(range(5, 14)), {"max_tokens": 8}, "longer than any output", None),
        ("room", {"max_tokens": None}, "reach max_model_len=256", "length"),
        ("room+1", {"max_tokens": None}, "longer than any output", None),
        ([5, 6], {"stop_token_ids": [6]}, "is a stop token id, which ends", "stop"),
        ([6, 5], {"stop_token_ids": [6]}, "cannot go on after it", None),
        (["eos"], {}, "is EOS", "stop"),
        (["eos", 5], {}, "cannot go on after it", None),
    ],
)
def test_bad_continuation_refused(llm, continuation, params, message, finished):
    """Refused, touching nothing; a whole output (it ends at its last token) as FinishedContinuation,
    which says how it ended (the gateway finishes a request it failed over with one)."""
    engine = llm.engine
    if isinstance(continuation, str):  # as many tokens as the context leaves (plus one)
        room = 256 - len(engine.tokenizer.encode(PROMPT))
        continuation = [5] * (room + continuation.count("+1"))
    continuation = [engine.eos_token_ids[0] if t == "eos" else t for t in continuation]
    with pytest.raises(ValueError, match=message) as e:
        engine.add_request("bad", PROMPT, SamplingParams(temperature=0, **params), continuation=continuation)
    assert isinstance(e.value, FinishedContinuation) == (finished is not None), repr(e.value)
    if isinstance(e.value, FinishedContinuation):
        assert e.value.reason == finished and e.value.stop_str is None
        assert e.value.stop_token_id == (6 if params.get("stop_token_ids") else None)
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
    ids = ref_final.outputs[0].token_ids
    with pytest.raises(ValueError, match="already finished: its text contains the stop string") as e:
        engine.add_request(
            "bad", PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[stop]), continuation=ids[:15]
        )
    assert not isinstance(e.value, FinishedContinuation)  # it matched before the last token: no output of this request
    # the shortest continuation whose text holds it: a whole output, ended by the stop string
    k = next(k for k in range(1, len(ids) + 1) if stop in engine.tokenizer.decode(ids[:k]))
    with pytest.raises(FinishedContinuation, match="already finished: its text contains the stop string") as e:
        engine.add_request(
            "bad", PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[stop]), continuation=ids[:k]
        )
    assert e.value.reason == "stop" and e.value.stop_str == stop and e.value.stop_token_id is None
    assert "bad" not in engine.requests
