"""--max-failovers bounds the moves in a row that brought no token (issue 23, defect 6): a
request that makes progress on every worker it lands on may move as often as workers fail; one
moved to workers that produce nothing ends UNAVAILABLE after ``max_failovers`` such moves, and 0
still means no mid-stream failover. No process: prepare_failover on a stand-in request record."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import structlog

from draftwise.gateway.admission import Admission
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.core import Core
from draftwise.gateway.errors import RequestError
from draftwise.gateway.failover import prepare_failover
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.router import Router
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb


@dataclass(eq=False)
class Record:
    """The fields failover reads and writes of a request (a Relay's)."""

    core: Core
    model: str = "m"
    deadline: float | None = None
    request: wpb.WorkerServiceGenerateRequest = field(
        default_factory=lambda: wpb.WorkerServiceGenerateRequest(
            start=pb.StartGeneration(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[1, 2])))
        )
    )
    base_id: str = "gw-0"
    tokens: list[int] = field(default_factory=list)
    spec: pb.SpeculationStats | None = None
    failovers: int = 0
    fruitless_moves: int = 0
    tokens_at_move: int = 0
    resubmits: int = 0
    prompt_tokens: int = 2
    log: Any = field(default_factory=structlog.get_logger)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def _record(max_failovers: int) -> Record:
    """A record over a real Core (its Router's channels need an event loop: made inside one)."""
    config = GatewayConfig(workers=("127.0.0.1:1",), max_failovers=max_failovers)
    metrics = GatewayMetrics()

    async def make() -> Core:
        return Core(config, Router(config.workers, metrics), Admission(16, 250), metrics, "gw")

    return Record(asyncio.run(make()))


def _fail(r: Record, new_tokens: int) -> None:
    """The worker it is on sent ``new_tokens`` tokens, then failed."""
    r.tokens.extend(range(r.num_tokens, r.num_tokens + new_tokens))
    prepare_failover(r, r.core.router.workers[0], "unavailable", "worker died")


def test_a_request_that_progresses_on_every_worker_moves_as_often_as_they_fail() -> None:
    r = _record(max_failovers=2)
    for _ in range(10):  # ten workers in a row die after one token each
        _fail(r, 1)
    assert r.failovers == 10 and r.fruitless_moves == 1
    assert r.request.start.request_id == "gw-0.10"
    assert list(r.request.start.continuation.output_token_ids) == list(range(10))


def test_moves_with_no_token_in_between_end_it_after_max_failovers() -> None:
    r = _record(max_failovers=2)
    _fail(r, 3)  # the first worker sent 3 tokens: a move that made progress
    _fail(r, 0)  # the second sent none
    with pytest.raises(RequestError) as e:
        _fail(r, 0)  # nor did the third
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "3 output tokens were delivered" in e.value.message and "2 times in a row" in e.value.message
    assert "--max-failovers=2" in e.value.message
    assert r.failovers == 2


def test_a_token_resets_the_count() -> None:
    r = _record(max_failovers=2)
    _fail(r, 1)
    _fail(r, 0)
    _fail(r, 1)  # progress on this worker: the count starts again
    _fail(r, 0)
    assert r.failovers == 4 and r.fruitless_moves == 2


def test_zero_means_no_mid_stream_failover() -> None:
    r = _record(max_failovers=0)
    with pytest.raises(RequestError, match="--max-failovers=0"):
        _fail(r, 5)
    assert r.failovers == 0
