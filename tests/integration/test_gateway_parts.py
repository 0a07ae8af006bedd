"""Pieces of the gateway the process tests rely on, checked directly: the coalescing
bounded queue (backpressure), API key loading and checking, admission counting."""

from __future__ import annotations

import asyncio

import pytest

from draftwise.gateway.admission import Admission
from draftwise.gateway.auth import ApiKeyInterceptor, load_api_keys
from draftwise.gateway.streams import Outbox
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb


def delta(rid: str, first: int, ids: list[int], text: str, spec: int | None = None) -> gspb.GenerateResponse:
    d = pb.TokenDelta(
        token_ids=ids,
        text=text,
        first_token_index=first,
        logprobs=[pb.TokenLogprob(token_id=t, logprob=-1.0, rank=1) for t in ids],
    )
    if spec is not None:
        d.speculation.proposed_tokens = spec
    return gspb.GenerateResponse(event=pb.GenerationEvent(request_id=rid, delta=d))


def finished(rid: str) -> gspb.GenerateResponse:
    return gspb.GenerateResponse(
        event=pb.GenerationEvent(request_id=rid, finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH))
    )


def test_outbox_coalesces_queued_deltas_per_request_in_order():
    async def main():
        box = Outbox(max_buffered_tokens=5)
        assert box.put_delta("a", delta("a", 0, [1], "x", spec=1))
        assert box.put_delta("b", delta("b", 0, [7], "q"))
        assert box.put_delta("a", delta("a", 1, [2, 3], "yz", spec=4))
        box.put_final("b", finished("b"))
        assert not box.put_delta("a", delta("a", 3, [4, 5, 6], "uvw"))  # 6 tokens queued > 5
        box.put_final("a", finished("a"))
        box.close()
        return [e async for e in _drain(box)]

    events = asyncio.run(main())
    kinds = [(e.event.request_id, e.event.WhichOneof("kind")) for e in events]
    assert kinds == [("a", "delta"), ("b", "delta"), ("b", "finished"), ("a", "finished")]
    a = events[0].event.delta
    assert list(a.token_ids) == [1, 2, 3, 4, 5, 6] and a.text == "xyzuvw" and a.first_token_index == 0
    assert [lp.token_id for lp in a.logprobs] == [1, 2, 3, 4, 5, 6]
    assert a.speculation.proposed_tokens == 4  # cumulative counters: the latest


def test_outbox_sent_delta_is_never_merged_into():
    async def main():
        box = Outbox(max_buffered_tokens=100)
        box.put_delta("a", delta("a", 0, [1], "x"))
        first = await box.get()
        box.put_delta("a", delta("a", 1, [2], "y"))  # a new entry: the first one is already out
        second = await box.get()
        return first, second

    first, second = asyncio.run(main())
    assert list(first.event.delta.token_ids) == [1] and list(second.event.delta.token_ids) == [2]
    assert second.event.delta.first_token_index == 1


async def _drain(box: Outbox):
    while (e := await box.get()) is not None:
        yield e


def test_api_keys(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# comment\n\n k1 \nk2\n")
    monkeypatch.setenv("MY_KEYS", "k3, k4")
    assert load_api_keys(f, "MY_KEYS") == {"k1", "k2", "k3", "k4"}
    assert load_api_keys(None, "UNSET_VARIABLE_FOR_SURE") == frozenset()
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "missing")
    check = ApiKeyInterceptor(frozenset({"k1", "k2"})).check
    assert check((("authorization", "Bearer k2"),)) is None
    assert check((("authorization", "bearer k1"),)) is None
    assert "missing" in check(())
    assert "invalid" in check((("authorization", "Bearer k3"),))
    assert "malformed" in check((("authorization", "k1"),))


def test_admission():
    a = Admission(max_in_flight=2, retry_after_ms=40)
    assert a.try_acquire() and a.try_acquire() and not a.try_acquire()
    assert "retry after 40 ms" in a.rejection() and ("retry-after-ms", "40") in a.trailing_metadata()
    a.release()
    assert a.try_acquire()
