"""Scheduler decisions, without a model: token budget, decode first, FCFS, max_num_seqs,
chunked prefill, preemption of the newest request."""

from __future__ import annotations

from draftwise.worker.core.block_manager import BlockManager
from draftwise.worker.core.request import Request, RequestStatus
from draftwise.worker.core.scheduler import Scheduler, SchedulerConfig
from draftwise.worker.sampling.sampling_params import SamplingParams


def _req(rid: str, prompt_len: int) -> Request:
    return Request(
        request_id=rid, prompt=None, prompt_token_ids=[1] * prompt_len, sampling_params=SamplingParams(), max_tokens=100
    )


def _advance(sched: Scheduler, out, sampled: int = 7) -> None:
    """What the engine does after a forward pass: progress, and a token for sequences that finished their chunk."""
    samples = [s.samples for s in out.scheduled]  # before progress moves
    sched.update_from_output(out.scheduled, {})
    for s, sample in zip(out.scheduled, samples, strict=True):
        if sample:
            s.request.output_token_ids.append(sampled)


def _plan(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_fills_budget_fcfs():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8), BlockManager(100, 4))
    for rid, n in [("a", 50), ("b", 10), ("c", 5)]:
        sched.add(_req(rid, n))
    out = sched.schedule()
    assert _plan(out) == [("a", 32)]
    _advance(sched, out)
    out = sched.schedule()
    assert _plan(out) == [("a", 18), ("b", 10), ("c", 4)]  # a finishes its prompt, then FCFS, c chunked
    assert [s.samples for s in out.scheduled] == [True, True, False]
    _advance(sched, out)
    out = sched.schedule()
    assert _plan(out) == [("a", 1), ("b", 1), ("c", 1)]  # decode first; c's last prompt token
    assert all(s.samples for s in out.scheduled)


def test_no_chunking_waits_for_room():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, enable_chunked_prefill=False), BlockManager(100, 4))
    sched.add(_req("a", 20))
    sched.add(_req("b", 20))
    out = sched.schedule()
    assert _plan(out) == [("a", 20)]  # b does not fit in what is left and is not split
    _advance(sched, out)
    assert _plan(sched.schedule()) == [("a", 1), ("b", 20)]


def test_max_num_seqs():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2), BlockManager(100, 4))
    for rid in "abc":
        sched.add(_req(rid, 3))
    out = sched.schedule()
    assert _plan(out) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preempts_newest_and_requeues_at_front():
    # 6 blocks of 4 tokens = 24 tokens
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), BlockManager(6, 4))
    a, b, c = _req("a", 8), _req("b", 8), _req("c", 8)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert _plan(out) == [("a", 8), ("b", 8), ("c", 8)]
    _advance(sched, out)
    # each now has 9 tokens and needs a third block; none free: c (newest) is preempted, freeing two
    out = sched.schedule()
    assert out.preempted == ["c"]
    assert _plan(out) == [("a", 1), ("b", 1)]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and not c.block_table
    assert list(sched.waiting) == [c] and c.output_token_ids == [7]  # nothing lost
    _advance(sched, out)
    sched.blocks.pool.check(r.block_table for r in (a, b))


def test_preempts_itself_when_newest():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(3, 4))
    a, b = _req("a", 4), _req("b", 8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert _plan(out) == [("a", 4), ("b", 8)]
    _advance(sched, out)
    # a needs a 2nd block, none free: b (newest) goes; then b is not scheduled
    out = sched.schedule()
    assert out.preempted == ["b"] and _plan(out) == [("a", 1)]
    _advance(sched, out)
    # b waits; with preemption over, it comes back when it fits: needs 9 tokens = 3 blocks, 1 free
    out = sched.schedule()
    assert _plan(out) == [("a", 1)]


def test_remove_frees_blocks():
    sched = Scheduler(SchedulerConfig(), BlockManager(10, 4))
    a = _req("a", 10)
    sched.add(a)
    sched.schedule()
    assert sched.blocks.num_free_blocks == 7
    sched.remove(a)
    assert sched.blocks.num_free_blocks == 10 and sched.num_unfinished == 0


def test_waiting_requests_are_admitted_before_drafts():
    """Drafts take only the budget and blocks left after running and waiting requests; a draft
    never displaces a prompt (and never preempts anyone)."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=8), BlockManager(100, 4))
    sched.add(_req("a", 4))
    out = sched.schedule()
    _advance(sched, out)  # a decodes from now on
    sched.add(_req("b", 8))
    out = sched.schedule({"a": 5, "b": 5})
    # a's decode token, b's whole prompt, then a's drafts from the 3 tokens left (not 5); b is
    # not decoding, so its entry is not read
    assert _plan(out) == [("a", 4), ("b", 8)]
    assert out.scheduled[0].num_draft_tokens == 3 and out.scheduled[1].num_draft_tokens == 0
    full = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=8), BlockManager(100, 4))
    for rid in "ab":
        full.add(_req(rid, 4))
    _advance(full, full.schedule())  # a and b decode from now on
    full.add(_req("c", 20))
    out = full.schedule({"a": 5, "b": 5})  # a and b decode (2 tokens), c's prompt takes the other 10: no draft
    assert _plan(out) == [("a", 1), ("b", 1), ("c", 10)]
    tight = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), BlockManager(3, 4))
    tight.add(_req("x", 4))
    _advance(tight, tight.schedule())  # x: 5 tokens, 2 blocks
    tight.add(_req("y", 4))
    out = tight.schedule({"x": 5})  # y takes the last block: x's drafts would need another
    assert _plan(out) == [("x", 1), ("y", 4)] and out.scheduled[0].num_draft_tokens == 0
    assert tight.blocks.num_free_blocks == 0
