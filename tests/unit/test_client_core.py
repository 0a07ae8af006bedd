"""The Python client's sans-IO core alone: crafted event sequences in, actions out. No server,
no network, no clock (time is passed in), no sleeping; jitter comes from a seeded generator.
Covers retry then success, retries used up, resume with duplicates dropped and gaps refused,
resumes refused and given up, deadlines, and a session's routing and reconnection."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
from draftwise_client import GenerationError, ResumePolicy, RetryPolicy  # noqa: E402
from draftwise_client._core import (  # noqa: E402
    Done,
    Ended,
    Failed,
    Raise,
    Received,
    Reconnect,
    RequestCore,
    Resume,
    Retry,
    Route,
    Send,
    SessionCore,
    Yield,
    session_request,
    stream_request,
)
from draftwise_client._proto import generation_pb2 as pb  # noqa: E402

S = grpc.StatusCode
T0 = 1000.0  # the monotonic time the tests start at
RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=1.0, jitter=0.0)
RESUME = ResumePolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=1.0, jitter=0.0)
DROPPED = Failed(S.UNAVAILABLE, "Socket closed")


def _core(rid: str = "r", deadline: float | None = None, **kw: object) -> RequestCore:
    start = pb.StartGeneration(request_id=rid, prompt=pb.Prompt(text="def f(x):"))
    policies = {"retry": RETRY, "resume": RESUME, **kw}
    return RequestCore(start, deadline=deadline, rng=random.Random(0), **policies)  # type: ignore[arg-type]


def _delta(first: int, n: int, handle: str = "", rid: str = "r") -> Received:
    ids = list(range(100 + first, 100 + first + n))
    delta = pb.TokenDelta(token_ids=ids, first_token_index=first, resume_handle=handle, text="x" * n)
    return Received(pb.GenerationEvent(request_id=rid, delta=delta))


def _final(n: int, rid: str = "r") -> Received:
    usage = pb.Usage(prompt_tokens=4, completion_tokens=n)
    finished = pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)
    return Received(pb.GenerationEvent(request_id=rid, finished=finished))


def _error_event(code: S, message: str = "", rid: str = "r", retry_after_ms: int = 0) -> Received:
    err = pb.RequestError(code=code.value[0], message=message, retry_after_ms=retry_after_ms)
    return Received(pb.GenerationEvent(request_id=rid, error=err))


def _tokens(action: object) -> list[int]:
    assert isinstance(action, Yield), action
    return [t for d in action.deltas for t in d.token_ids]


def test_retry_then_success():
    core = _core()
    assert core.begin() == Send(core.start)
    with pytest.raises(RuntimeError):
        core.begin()
    busy = Failed(S.RESOURCE_EXHAUSTED, "at capacity", (("grpc-retry-pushback-ms", "250"),))
    first = core.step(busy, T0)
    assert isinstance(first, Retry) and first.attempt == 2 and first.start is core.start
    assert first.delay_s == pytest.approx(0.25)  # the server's hint beats the 0.1 s backoff
    assert first.error.code == S.RESOURCE_EXHAUSTED and first.error.retry_after_ms == 250
    assert stream_request(first).start == core.start
    second = core.step(Failed(S.UNAVAILABLE, "no healthy worker"), T0 + 1)
    assert isinstance(second, Retry) and second.attempt == 3 and second.delay_s == pytest.approx(0.2)
    assert _tokens(core.step(_delta(0, 2, "h"), T0 + 2)) == [100, 101]
    last = core.step(_final(2), T0 + 2)
    assert isinstance(last, Yield) and last.final and last.deltas[0].finish_reason == "length"
    assert core.step(Ended(), T0 + 2) == Done()
    assert core.attempts == 3 and core.resumes == 0


def test_retries_used_up_and_codes_never_retried():
    core = _core()
    core.begin()
    assert isinstance(core.step(Failed(S.UNAVAILABLE), T0), Retry)
    assert isinstance(core.step(Failed(S.UNAVAILABLE), T0), Retry)
    out = core.step(Failed(S.UNAVAILABLE, "no healthy worker"), T0)
    assert isinstance(out, Raise) and out.error.code == S.UNAVAILABLE and out.error.attempts == 3
    for code in (S.INVALID_ARGUMENT, S.DEADLINE_EXCEEDED, S.UNAUTHENTICATED, S.INTERNAL):
        core = _core()
        core.begin()
        out = core.step(Failed(code, "no"), T0)
        assert isinstance(out, Raise) and out.error.code == code and out.error.attempts == 1
    core = _core()
    core.begin()  # a negative pushback: do not retry
    assert isinstance(core.step(Failed(S.RESOURCE_EXHAUSTED, "", (("grpc-retry-pushback-ms", "-1"),)), T0), Raise)
    core = _core(retry=RetryPolicy.off())
    core.begin()
    assert isinstance(core.step(Failed(S.RESOURCE_EXHAUSTED), T0), Raise)


def test_never_retried_once_a_token_arrived():
    core = _core()  # a server that gives no resume handle: nothing can be resumed either
    core.begin()
    core.step(_delta(0, 3), T0)
    out = core.step(Failed(S.UNAVAILABLE, "worker became unavailable after 3 tokens"), T0)
    assert isinstance(out, Raise) and out.error.attempts == 1 and out.error.resumes == 0


def test_resume_drops_duplicates_and_refuses_gaps():
    core = _core()
    core.begin()
    assert _tokens(core.step(_delta(0, 2, "h"), T0)) == [100, 101]
    assert _tokens(core.step(_delta(2, 3), T0)) == [102, 103, 104]
    resume = core.step(DROPPED, T0)
    assert resume == Resume("h", 5, pytest.approx(0.05), resume.error, "r")  # type: ignore[union-attr]
    assert isinstance(resume, Resume) and resume.error.message == "Socket closed" and core.resumes == 1
    msg = stream_request(resume)
    assert msg.resume.resume_handle == "h" and msg.resume.next_token_index == 5 and not msg.resume.request_id
    assert session_request(resume).resume.request_id == "r"
    assert core.step(_delta(2, 3), T0) == Yield(())  # replayed: the caller has it
    assert _tokens(core.step(_delta(5, 2), T0)) == [105, 106]
    gap = core.step(_delta(9, 1), T0)
    assert isinstance(gap, Raise) and gap.error.code == S.DATA_LOSS and gap.error.resumes == 1
    overlap = _core()
    overlap.begin()
    overlap.step(_delta(0, 4, "h"), T0)
    out = overlap.step(_delta(2, 4), T0)  # starts inside what was received, runs past it
    assert isinstance(out, Raise) and out.error.code == S.DATA_LOSS


def test_a_transport_error_after_a_delta_is_resumed_other_errors_are_not():
    core = _core()
    core.begin()
    core.step(_delta(0, 1, "h"), T0)
    assert isinstance(core.step(Failed(S.INTERNAL, "Stream removed"), T0), Resume)  # torn down under us
    core.step(_delta(1, 1), T0)
    out = core.step(Failed(S.INVALID_ARGUMENT, "bad"), T0)
    assert isinstance(out, Raise) and out.error.code == S.INVALID_ARGUMENT


def test_resume_refused():
    lost = _core()  # a known request that can no longer be resumed: NOT_FOUND is the news
    lost.begin()
    lost.step(_delta(0, 1, "h"), T0)
    assert isinstance(lost.step(DROPPED, T0), Resume)
    out = lost.step(Failed(S.NOT_FOUND, "the request can no longer be resumed: buffer full"), T0)
    assert isinstance(out, Raise) and out.error.code == S.NOT_FOUND and out.error.resumes == 1
    ended_there = _core()  # the server itself ended it UNAVAILABLE: that is why it ended
    ended_there.begin()
    ended_there.step(_delta(0, 1, "h"), T0)
    assert isinstance(ended_there.step(Failed(S.UNAVAILABLE, "worker gone; moved 2 times"), T0), Resume)
    out = ended_there.step(Failed(S.NOT_FOUND, "no request with this resume handle"), T0)
    assert isinstance(out, Raise) and out.error.code == S.UNAVAILABLE and "moved 2 times" in out.error.message
    chain = _core()  # a plain drop while resuming after it: the first failure still says why
    chain.begin()
    chain.step(_delta(0, 1, "h"), T0)
    assert isinstance(chain.step(Failed(S.UNAVAILABLE, "worker gone; moved 2 times"), T0), Resume)
    assert isinstance(chain.step(DROPPED, T0), Resume)
    out = chain.step(Failed(S.NOT_FOUND, "no request with this resume handle"), T0)
    assert isinstance(out, Raise) and out.error.code == S.UNAVAILABLE and out.error.resumes == 2
    on_session = _core()  # the same answer as an error event on a session's stream
    on_session.begin()
    on_session.step(_delta(0, 1, "h"), T0)
    on_session.reattach(GenerationError(S.UNAVAILABLE, "worker gone"))
    out = on_session.step(_error_event(S.NOT_FOUND, "no request with this resume handle"), T0)
    assert isinstance(out, Raise) and out.error.code == S.UNAVAILABLE and out.error.message == "worker gone"


def test_resumes_in_a_row_are_bounded_and_counted_again_after_an_event():
    core = _core()
    core.begin()
    core.step(_delta(0, 1, "h"), T0)
    assert [type(core.step(DROPPED, T0)) for _ in range(2)] == [Resume, Resume]
    out = core.step(DROPPED, T0)
    assert isinstance(out, Raise) and out.error.resumes == 2  # ResumePolicy.max_attempts
    steady = _core()
    steady.begin()
    steady.step(_delta(0, 1, "h"), T0)
    for i in range(1, 6):  # an event between drops: each is the first in a row again
        out = steady.step(DROPPED, T0)
        assert isinstance(out, Resume) and out.delay_s == pytest.approx(0.05)
        steady.step(_delta(i, 1), T0)
    assert steady.resumes == 5
    off = _core(resume=ResumePolicy.off())
    off.begin()
    off.step(_delta(0, 1, "h"), T0)
    out = off.step(DROPPED, T0)
    assert isinstance(out, Raise) and out.error.resumes == 0


def test_deadline():
    core = _core(deadline=T0 + 0.15)
    core.begin()
    assert core.timeout(T0) == pytest.approx(0.15) and core.timeout(T0 + 1) == 0.0
    assert isinstance(core.step(Failed(S.UNAVAILABLE), T0), Retry)  # 0.1 s fits
    out = core.step(Failed(S.UNAVAILABLE), T0 + 0.01)  # 0.2 s does not
    assert isinstance(out, Raise) and out.error.attempts == 2
    hinted = _core(deadline=T0 + 1)
    hinted.begin()  # the server asks for 5 s: past the deadline
    assert isinstance(hinted.step(Failed(S.RESOURCE_EXHAUSTED, "", (("retry-after-ms", "5000"),)), T0), Raise)
    resumed = _core(deadline=T0 + 1)
    resumed.begin()
    resumed.step(_delta(0, 1, "h"), T0)
    assert isinstance(resumed.step(DROPPED, T0), Resume)
    assert isinstance(resumed.step(DROPPED, T0 + 0.99), Raise)
    assert _core().timeout(T0) is None


def test_the_end_of_a_call():
    core = _core()
    core.begin()
    core.step(_delta(0, 1, "h"), T0)
    out = core.step(Ended(), T0)  # ended OK without the final event: something is missing
    assert isinstance(out, Raise) and out.error.code == S.UNKNOWN
    done = _core()
    done.begin()
    done.step(_final(0), T0)
    assert done.finished and done.step(DROPPED, T0) == Done()  # broke after the final event
    assert done.step(_final(0), T0) == Yield(())  # a replayed final event


def test_jitter_stretches_within_bounds():
    policy = RetryPolicy(max_attempts=50, initial_backoff_s=0.1, max_backoff_s=0.1, jitter=0.5)
    core = _core(retry=policy)
    core.begin()
    delays = [core.step(Failed(S.UNAVAILABLE), T0).delay_s for _ in range(40)]  # type: ignore[union-attr]
    assert all(0.1 <= d <= 0.15 for d in delays) and len(set(delays)) > 30


def test_error_events_on_a_session():
    core = _core()
    core.begin()
    out = core.step(_error_event(S.RESOURCE_EXHAUSTED, "at capacity", retry_after_ms=300), T0)
    assert isinstance(out, Retry) and out.delay_s == pytest.approx(0.3) and out.attempt == 2
    assert isinstance(core.step(_error_event(S.INVALID_ARGUMENT, "top_p"), T0), Raise)
    cancelled = _core()
    cancelled.begin()
    cancelled.cancel()  # refused after the caller cancelled it: not sent again
    assert isinstance(cancelled.step(_error_event(S.RESOURCE_EXHAUSTED), T0), Raise)


def _session(*rids: str, **kw: object) -> tuple[SessionCore, dict[str, RequestCore]]:
    session = SessionCore(RESUME, rng=random.Random(0), **kw)  # type: ignore[arg-type]
    cores = {rid: _core(rid) for rid in rids}
    for rid, core in cores.items():
        assert session.add(core).start.request_id == rid
    return session, cores


def test_session_routes_events_and_forgets_finished_requests():
    session, cores = _session("a", "b")
    with pytest.raises(ValueError):
        session.add(_core("a"))  # an id in flight
    (route,) = session.step(_delta(0, 2, "ha", rid="a"), T0)
    assert route.request_id == "a" and _tokens(route.action) == [100, 101]
    assert session.step(_delta(0, 2, rid="a"), T0) == []  # a replay: nothing to hand on
    assert session.step(_delta(0, 1, rid="nobody"), T0) == []
    (route,) = session.step(_final(2, rid="a"), T0)
    assert isinstance(route.action, Yield) and route.action.final and set(session.requests) == {"b"}
    (route,) = session.step(_error_event(S.RESOURCE_EXHAUSTED, rid="b"), T0)
    assert isinstance(route.action, Retry) and not session.requests  # out until its retry is sent
    assert session.add(cores["b"]).start.request_id == "b" and cores["b"].attempts == 2
    (route,) = session.step(Ended(), T0)
    assert route == Route("b", route.action) and isinstance(route.action, Raise)
    assert route.action.error.code == S.UNKNOWN and route.action.error.request_id == "b"


def test_session_reconnects_and_carries_every_request_over():
    session, cores = _session("a", "b", "c")
    session.step(_delta(0, 3, "ha", rid="a"), T0)
    session.step(_delta(0, 1, "hc", rid="c"), T0)
    cores["c"].cancel()
    (reconnect,) = session.step(DROPPED, T0)
    assert isinstance(reconnect, Reconnect) and reconnect.delay_s == pytest.approx(0.05)
    messages = session.reattach(reconnect.error)
    kinds = [(m.WhichOneof("action"), m) for m in messages]
    assert [k for k, _ in kinds] == ["resume", "start", "resume", "cancel"]
    assert messages[0].resume.resume_handle == "ha" and messages[0].resume.next_token_index == 3
    assert messages[0].resume.request_id == "a" and messages[1].start.request_id == "b"
    assert messages[3].cancel.request_id == "c"
    assert session.reconnects == 1 and cores["a"].resumes == 1 and cores["b"].attempts == 2
    assert session.step(_delta(0, 3, rid="a"), T0) == []  # a replay after the resume: dropped
    (route,) = session.step(_delta(3, 1, rid="a"), T0)
    assert route.request_id == "a" and _tokens(route.action) == [103] and cores["a"].progress.cause is None


def test_session_gives_up_and_fails_every_request():
    session, _ = _session("a", "b")
    session.step(_delta(0, 1, "ha", rid="a"), T0)
    assert isinstance(session.step(DROPPED, T0)[0], Reconnect)
    assert isinstance(session.step(DROPPED, T0)[0], Reconnect)
    routes = session.step(DROPPED, T0)  # a third in a row: ResumePolicy.max_attempts is 2
    assert [r.request_id for r in routes] == ["a", "b"] and not session.requests
    for r in routes:
        assert isinstance(r.action, Raise) and r.action.error.code == S.UNAVAILABLE
        assert r.action.error.request_id == r.request_id
    fatal, _ = _session("a")
    (route,) = fatal.step(Failed(S.UNAUTHENTICATED, "bad key"), T0)
    assert isinstance(route.action, Raise) and route.action.error.code == S.UNAUTHENTICATED
    idle = SessionCore(RESUME)
    assert idle.step(DROPPED, T0) == []  # nothing in flight: nothing to carry over
    late = SessionCore(RESUME, deadline=T0 + 0.01)
    late.add(_core("a"))
    (route,) = late.step(DROPPED, T0)
    assert isinstance(route.action, Raise)  # the reconnection would pass the deadline


# -- a resume whose handle the gateway answering does not know: go on as a continuation ----------

UNKNOWN = "no request with this resume handle on this gateway: it was never started here"
REASON = (("draftwise-resume-reason", "unknown-handle"),)


def _spec_delta(first: int, n: int, handle: str = "", proposed: int = 0) -> Received:
    event = _delta(first, n, handle)
    event.event.delta.speculation.CopyFrom(pb.SpeculationStats(proposed_tokens=proposed, accepted_tokens=proposed // 2))
    return event


def test_an_unknown_handle_after_a_drop_sends_the_start_again_as_a_continuation():
    """Another replica (or the same one after the retention time) answers the resume NOT_FOUND
    for an unknown handle: the request's own start goes out again, with the tokens the caller
    holds and the latest speculation counters as its continuation, at once."""
    for failed in (Failed(S.NOT_FOUND, UNKNOWN), Failed(S.NOT_FOUND, "other words", REASON)):
        core = _core()
        core.begin()
        core.step(_spec_delta(0, 2, "h", proposed=4), T0)
        core.step(_spec_delta(2, 3, proposed=8), T0)
        assert isinstance(core.step(DROPPED, T0), Resume)
        out = core.step(failed, T0)
        assert isinstance(out, Resume) and out.start is not None and out.delay_s == 0.0
        assert out.start.request_id == "r" and out.start.prompt.text == "def f(x):"
        assert list(out.start.continuation.output_token_ids) == [100, 101, 102, 103, 104]
        assert out.start.continuation.speculation.proposed_tokens == 8
        assert not core.start.HasField("continuation")  # the original start is left alone
        message = stream_request(out)
        assert message.HasField("start") and not message.HasField("resume") and message.start == out.start
        assert session_request(out).start == out.start
        assert core.resumes == 1 and core.continuations == 1
        # the continuation's deltas go on at the same index, with a new handle, no gap
        assert _tokens(core.step(_delta(5, 2, "h2"), T0)) == [105, 106]
        assert core.progress.handle == "h2" and not core.progress.continued
        assert isinstance(core.step(_final(7), T0), Yield)


def test_a_continuation_dropped_before_its_first_delta_is_sent_again_within_the_policy():
    core = _core()
    core.begin()
    core.step(_delta(0, 1, "h"), T0)
    core.step(DROPPED, T0)
    assert isinstance(core.step(Failed(S.NOT_FOUND, UNKNOWN), T0), Resume)
    again = core.step(DROPPED, T0)  # no handle yet: the same continuation, not a resume
    assert isinstance(again, Resume) and again.start is not None and again.delay_s > 0
    assert list(again.start.continuation.output_token_ids) == [100]
    out = core.step(DROPPED, T0)  # ResumePolicy.max_attempts in a row
    assert isinstance(out, Raise) and is_transport(out.error)


def is_transport(error: GenerationError) -> bool:
    return error.code == S.UNAVAILABLE


def test_no_continuation_where_the_server_ended_the_request_or_nothing_was_resumed():
    ended_there = _core()  # the server itself ended it UNAVAILABLE: raise why
    ended_there.begin()
    ended_there.step(_delta(0, 1, "h"), T0)
    ended_there.step(Failed(S.UNAVAILABLE, "worker gone; moved 2 times"), T0)
    out = ended_there.step(Failed(S.NOT_FOUND, UNKNOWN, REASON), T0)
    assert isinstance(out, Raise) and "moved 2 times" in out.error.message
    fresh = _core()  # NOT_FOUND to a start (a model, say) is not about a handle
    fresh.begin()
    out = fresh.step(Failed(S.NOT_FOUND, "no model named x"), T0)
    assert isinstance(out, Raise) and out.error.code == S.NOT_FOUND
    other = _core()  # another NOT_FOUND of a resume: raised as it is
    other.begin()
    other.step(_delta(0, 1, "h"), T0)
    other.step(DROPPED, T0)
    out = other.step(Failed(S.NOT_FOUND, "the request can no longer be resumed"), T0)
    assert isinstance(out, Raise) and out.error.code == S.NOT_FOUND


def test_a_session_request_goes_on_as_a_continuation_on_the_same_stream():
    """On a session the answer is an error event on the new stream: the request stays in
    flight and the driver writes its start, with the continuation, on that stream."""
    session = SessionCore(RESUME)
    core = _core()
    session.add(core)
    session.step(_delta(0, 2, "h"), T0)
    (reconnect,) = session.step(DROPPED, T0)
    assert isinstance(reconnect, Reconnect)
    (message,) = session.reattach(reconnect.error)
    assert message.HasField("resume")
    (route,) = session.step(_error_event(S.NOT_FOUND, UNKNOWN), T0)
    assert isinstance(route, Route) and isinstance(route.action, Resume) and route.action.start is not None
    assert "r" in session.requests  # still in flight on this stream
    assert session_request(route.action).start.continuation.output_token_ids == [100, 101]
    (yielded,) = session.step(_delta(2, 1, "h2"), T0)
    assert isinstance(yielded.action, Yield) and _tokens(yielded.action) == [102]
    (reconnect,) = session.step(DROPPED, T0)  # dropped again: resumed by the new handle
    (message,) = session.reattach(reconnect.error)
    assert message.resume.resume_handle == "h2" and message.resume.next_token_index == 3
