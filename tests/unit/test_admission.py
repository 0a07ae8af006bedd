"""Admission's rejection (message, pushback trailers, RetryInfo detail), the one admission
decision every front makes (``admit``), the gateway's message parsing with its size limit,
and the clipping of client input quoted in errors."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from draftwise.gateway.admission import Admission
from draftwise.gateway.admit import DRAINING_MESSAGE, Admitted, Refused, Why, admit
from draftwise.gateway.config import DEFAULT_MAX_REQUEST_BYTES, MAX_RECEIVE_BYTES, GatewayConfig
from draftwise.gateway.core import Core
from draftwise.gateway.errors import CLIP_CHARS, RequestError, clip
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.router import Router
from draftwise.gateway.validate import parse_request
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb


def test_rejection_carries_pushback_and_retry_info():
    a = Admission(max_in_flight=3, retry_after_ms=1500)
    md = dict(a.trailing_metadata())
    assert md["grpc-retry-pushback-ms"] == "1500" and md["retry-after-ms"] == "1500"
    status = status_pb2.Status.FromString(md["grpc-status-details-bin"])
    assert status.code == code_pb2.RESOURCE_EXHAUSTED and status.message == a.rejection()
    (detail,) = status.details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info) and info.retry_delay.ToMilliseconds() == 1500
    assert "retry after 1500 ms" in a.rejection()
    assert a.trailing_metadata() is a.trailing_metadata()  # built once: rejecting costs nothing


def test_slots():
    a = Admission(max_in_flight=2, retry_after_ms=10)
    assert a.try_acquire() and a.try_acquire() and not a.try_acquire()
    a.release()
    assert a.try_acquire()
    a.release()
    a.release()
    with pytest.raises(RuntimeError):
        a.release()


def _core(max_in_flight: int = 1) -> Core:
    """A gateway's shared state with no worker (nothing is polled or connected)."""
    metrics = GatewayMetrics()
    return Core(GatewayConfig(), Router((), metrics), Admission(max_in_flight, 250), metrics, "t")


def _refusals(core: Core, status: str) -> float:
    return core.metrics.registry.get_sample_value("draftwise_requests_total", {"status": status}) or 0.0


def test_admit_answers_with_a_ticket_or_a_counted_refusal():
    core = _core(max_in_flight=1)
    start = pb.StartGeneration(request_id="a", prompt=pb.Prompt(text="hi"))
    # the gateway's own checks: no worker has reported a model
    refused = admit(core, start)
    assert isinstance(refused, Refused) and refused.why == Why.INVALID
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "no worker has reported its model" in refused.message
    assert _refusals(core, "unavailable") == 1 and core.admission.in_flight == 0
    # a front's own checks pick the model; the ticket holds the one slot
    ticket = admit(core, start, check=lambda _core, _start: "m")
    assert ticket == Admitted("m") and core.admission.in_flight == 1
    full = admit(core, start, check=lambda _core, _start: "m")
    assert isinstance(full, Refused) and full.why == Why.AT_CAPACITY
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED and full.message == core.admission.rejection()
    assert full.retry_after_ms == 250 and _refusals(core, "resource_exhausted") == 1
    core.admission.release()
    core.draining = True  # draining comes first: nothing is checked, no slot taken
    calls: list[str] = []
    draining = admit(core, start, check=lambda _core, _start: calls.append("checked") or "m")
    assert draining == Refused(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE, Why.DRAINING)
    assert not calls and core.admission.in_flight == 0 and _refusals(core, "unavailable") == 2


def test_parse_request_limits_and_malformed_bytes():
    msg = gspb.GenerateRequest(start=pb.StartGeneration(request_id="a", prompt=pb.Prompt(text="hi")))
    data = msg.SerializeToString()
    assert parse_request(data, gspb.GenerateRequest, len(data)) == msg
    with pytest.raises(RequestError) as e:
        parse_request(data, gspb.GenerateRequest, len(data) - 1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and str(len(data) - 1) in e.value.message
    with pytest.raises(RequestError) as e:
        parse_request(b"\xff\xff\xff", gspb.GenerateRequest, 1 << 20)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "malformed message" in e.value.message


def test_clip():
    assert clip("abc") == "abc"
    long = "x" * 10_000
    assert clip(long) == "x" * CLIP_CHARS + "..."
    assert len(clip(long, 10)) == 13


def test_request_limit_config():
    assert GatewayConfig().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES < 4 << 20
    with pytest.raises(ValueError, match="max_request_bytes"):
        GatewayConfig(max_request_bytes=0)
    with pytest.raises(ValueError, match="max_request_bytes"):
        GatewayConfig(max_request_bytes=MAX_RECEIVE_BYTES + 1)
