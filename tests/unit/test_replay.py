"""Replay buffers of resumable requests: resume points are delta boundaries, events come back
from there on (the final one included), bytes are counted per request and gateway-wide, and
a request that passes either cap loses resumability (and gives its bytes back)."""

from __future__ import annotations

import argparse

import pytest

from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.main import add_gateway_args, config_from_args
from draftwise.gateway.replay import ReplayBudget, ReplayBuffer, ResumeError, new_handle
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb


def _delta(first: int, ids: list[int], text: str) -> gspb.GenerateResponse:
    d = pb.TokenDelta(token_ids=ids, text=text, first_token_index=first)
    return gspb.GenerateResponse(event=pb.GenerationEvent(request_id="orig", delta=d))


def _final() -> gspb.GenerateResponse:
    f = pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=3, completion_tokens=5))
    return gspb.GenerateResponse(event=pb.GenerationEvent(request_id="orig", finished=f))


def _filled(limit: int = 1 << 20, total: int = 1 << 20) -> tuple[ReplayBudget, ReplayBuffer]:
    budget = ReplayBudget(total)
    buf = ReplayBuffer(budget, limit)
    buf.add_delta(_delta(0, [1, 2], "ab"))
    buf.add_delta(_delta(2, [3], "c"))
    buf.add_delta(_delta(3, [4, 5], "de"))
    return budget, buf


def test_replay_from_each_boundary():
    budget, buf = _filled()
    assert buf.num_tokens == 5 and budget.used == buf.size > 0
    for start, texts in {0: ["ab", "c", "de"], 2: ["c", "de"], 3: ["de"], 5: []}.items():
        events = buf.replay(start, "new-id")
        assert [e.event.delta.text for e in events] == texts
        assert all(e.event.request_id == "new-id" for e in events)
    buf.set_final(_final())
    events = buf.replay(5, "x")
    assert [e.event.WhichOneof("kind") for e in events] == ["finished"]
    assert events[0].event.finished.usage.completion_tokens == 5


@pytest.mark.parametrize(("index", "words"), [(1, "not a delta boundary"), (4, "not a delta boundary"), (6, "beyond")])
def test_bad_resume_points_are_invalid_argument(index, words):
    _, buf = _filled()
    with pytest.raises(ResumeError) as info:
        buf.replay(index, "x")
    assert info.value.code == "invalid_argument" and words in info.value.message


def test_per_request_cap_loses_resumability_and_frees_bytes():
    size = len(_delta(0, [1, 2], "ab").SerializeToString())
    budget = ReplayBudget(1 << 20)
    buf = ReplayBuffer(budget, limit=size * 2)
    buf.add_delta(_delta(0, [1, 2], "ab"))
    assert buf.lost is None and budget.used == size
    buf.add_delta(_delta(2, [3, 4], "cd"))
    buf.add_delta(_delta(4, [5, 6], "ef"))  # past the cap
    assert buf.lost is not None and "--resume-buffer-bytes" in buf.lost
    assert budget.used == 0 and buf.size == 0 and buf.num_tokens == 6  # tokens still counted
    with pytest.raises(ResumeError) as info:
        buf.replay(0, "x")
    assert info.value.code == "not_found" and "can no longer be resumed" in info.value.message


def test_gateway_wide_cap_is_shared():
    first, second = (len(_delta(i, [1, 2], "ab").SerializeToString()) for i in (0, 2))
    budget = ReplayBudget(first * 2 + second)
    a, b = ReplayBuffer(budget, 1 << 20), ReplayBuffer(budget, 1 << 20)
    a.add_delta(_delta(0, [1, 2], "ab"))
    a.add_delta(_delta(2, [1, 2], "ab"))
    b.add_delta(_delta(0, [1, 2], "ab"))
    assert budget.used == budget.limit and a.lost is None and b.lost is None
    b.add_delta(_delta(2, [1, 2], "ab"))  # no room left: b loses resumability, a keeps its events
    assert b.lost is not None and "--resume-buffer-total-bytes" in b.lost
    assert a.lost is None and budget.used == first + second
    a.drop("finished")
    assert budget.used == 0


def test_handles_are_unguessable_and_url_safe():
    handles = {new_handle() for _ in range(1000)}
    assert len(handles) == 1000
    assert all(len(h) >= 22 and h.replace("-", "").replace("_", "").isalnum() for h in handles)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_failovers", -1, "max_failovers must be >= 0"),
        ("failover_stall_s", 0, "failover_stall_s must be > 0"),
        ("failover_wait_s", -1.0, "failover_wait_s must be > 0"),
        ("resume_retention_s", -1.0, "resume_retention_s must be >= 0"),
        ("resume_buffer_bytes", -1, "must be >= 0"),
        ("resume_buffer_total_bytes", -1, "must be >= 0"),
    ],
)
def test_failover_and_resume_settings_are_validated(field, value, words):
    with pytest.raises(ValueError, match=words):
        GatewayConfig(**{field: value})


def test_failover_and_resume_flags():
    p = argparse.ArgumentParser()
    add_gateway_args(p)
    flags = ["--max-failovers=1", "--failover-stall-s=5", "--failover-wait-s=3", "--resume-retention-s=0"]
    flags += ["--resume-buffer-bytes=100", "--resume-buffer-total-bytes=1000"]
    c = config_from_args(p.parse_args(flags), ("127.0.0.1:1",))
    assert (c.max_failovers, c.failover_stall_s, c.failover_wait_s, c.resume_retention_s) == (1, 5.0, 3.0, 0.0)
    assert (c.resume_buffer_bytes, c.resume_buffer_total_bytes) == (100, 1000)
    d = config_from_args(p.parse_args([]), ("127.0.0.1:1",))
    assert (d.max_failovers, d.failover_stall_s, d.resume_retention_s) == (2, 30.0, 60.0)
