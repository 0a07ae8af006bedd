"""Cache-aware routing (issue 26): route keys from prompts, and the policy of a real Router over
crafted loads: new keys spread over the workers, a known key sticks to its worker, spills past
the load bound, moves when its worker is gone, unhealthy or draining, is never sent back to a
worker a failover excluded, and is forgotten when its worker restarts or retires; the table
stays within its size. No process: polls are answered by stand-ins of the GetLoad call."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import prometheus_client
import pytest

from draftwise.gateway.admission import Admission
from draftwise.gateway.admit import Admitted
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.core import Core
from draftwise.gateway.failover import as_continuation, pick
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.prefix_routing import over_bound, prompt_prefix, route_key
from draftwise.gateway.relay import Relay
from draftwise.gateway.router import Router, WorkerHandle
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb

ADDRESSES = ("127.0.0.1:1", "127.0.0.1:2")
CONFIG = GatewayConfig(workers=ADDRESSES)


def key(i: int | str, salt: str = "", model: str = "m") -> bytes:
    k = route_key(CONFIG, salt, model, pb.Prompt(text=f"prefix {i} " * 100))
    assert k is not None
    return k


class _Answer:
    """A GetLoad call answered with ``load``."""

    def __init__(self, load: wpb.GetLoadResponse) -> None:
        self.load = load

    def __await__(self):
        return self._get().__await__()

    async def _get(self) -> wpb.GetLoadResponse:
        return self.load

    async def trailing_metadata(self) -> tuple[()]:
        return ()


async def answer(router: Router, w: WorkerHandle, **load: object) -> None:
    """Let ``w`` answer one poll with ``load`` (model "m" unless given)."""
    msg = wpb.GetLoadResponse(**{"model": "m", "num_total_kv_blocks": 100, "num_free_kv_blocks": 100, **load})
    w.get_load = lambda *a, **kw: _Answer(msg)
    await router._poll_once(w)


def run(test: Callable[[Router], object], n: int = 2, **kw: object) -> None:
    """``test(router)`` (a coroutine function) with a real Router over ``n`` polled-healthy workers."""

    async def main() -> None:
        router = Router(tuple(f"127.0.0.1:{i + 1}" for i in range(n)), GatewayMetrics(), **kw)  # type: ignore[arg-type]
        try:
            for w in router.workers:
                await answer(router, w, worker_started_at=1000.0)
            await test(router)  # type: ignore[misc]
        finally:
            await router.close()

    asyncio.run(main())


def outcomes(router: Router) -> dict[str, float]:
    out = {}
    for metric in router.metrics.routing_decisions.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[s.labels["outcome"]] = s.value
    return out


def dropped(router: Router, reason: str) -> float:
    value = router.metrics.registry.get_sample_value("draftwise_routing_keys_dropped_total", {"reason": reason})
    return value or 0.0


# --- route keys -----------------------------------------------------------------------------


def test_route_keys_depend_on_the_first_bytes_salt_and_model_only():
    long = "You are a helpful assistant. " * 40
    a = route_key(CONFIG, "", "m", pb.Prompt(text=long + "Question one?"))
    assert a == route_key(CONFIG, "", "m", pb.Prompt(text=long + "Another question entirely"))
    assert a != route_key(CONFIG, "salt", "m", pb.Prompt(text=long))
    assert a != route_key(CONFIG, "", "m2", pb.Prompt(text=long))
    assert route_key(CONFIG, "", "m", pb.Prompt(text="short a")) != route_key(
        CONFIG, "", "m", pb.Prompt(text="short b")
    )
    assert route_key(GatewayConfig(routing="least-loaded"), "", "m", pb.Prompt(text=long)) is None
    narrow = GatewayConfig(prefix_routing_bytes=8)
    assert route_key(narrow, "", "m", pb.Prompt(text="12345678x")) == route_key(
        narrow, "", "m", pb.Prompt(text="12345678y")
    )
    assert len(prompt_prefix(pb.Prompt(text="é" * 1000), 512)) == 513  # bytes, not characters


def test_token_id_and_chat_prompts_render_canonically():
    ids = pb.Prompt(token_ids=pb.TokenIds(ids=list(range(1000))))
    assert prompt_prefix(ids, 512) == b"i" + b"".join(i.to_bytes(4, "little") for i in range(128))
    more = pb.Prompt(token_ids=pb.TokenIds(ids=[*range(128), 7, 7, 7]))
    assert route_key(CONFIG, "", "m", ids) == route_key(CONFIG, "", "m", more)

    def chat(*messages: tuple[str, str]) -> pb.Prompt:
        return pb.Prompt(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))

    system = ("system", "You answer in French. " * 30)
    assert route_key(CONFIG, "", "m", chat(system, ("user", "a"))) == route_key(
        CONFIG, "", "m", chat(system, ("user", "b"))
    )
    short = [("system", "be brief"), ("user", "hi")]
    assert prompt_prefix(chat(*short), 512) != prompt_prefix(chat(*reversed(short)), 512)
    # role and content boundaries are part of the rendering
    assert prompt_prefix(chat(("user", "ab")), 512) != prompt_prefix(chat(("usera", "b")), 512)
    assert prompt_prefix(chat(("user", "x" * 5000)), 512) == prompt_prefix(chat(("user", "x" * 6000)), 512)


# --- the policy -----------------------------------------------------------------------------


def test_new_keys_spread_evenly_and_known_keys_stick():
    async def test(router: Router) -> None:
        chosen = {i: router.pick("m", key=key(i)) for i in range(8)}
        counts = collections.Counter(w.name for w in chosen.values() if w is not None)
        assert sorted(counts.values()) == [4, 4]
        assert router.prefix is not None and len(router.prefix) == 8
        for _ in range(3):
            for i in range(8):
                assert router.pick("m", key=key(i)) is chosen[i]
        assert outcomes(router) == {"new": 8, "hit": 24}

    run(test)


def test_new_keys_go_by_keys_held_before_the_polled_queue():
    """A queue seen by a poll (up to half a second old) does not outweigh the keys a worker holds."""

    async def test(router: Router) -> None:
        w0, w1 = router.workers
        assert router.pick("m", key=key(1)) is not None
        holder = router.worker(router.prefix.owner(key(1)) or "")  # type: ignore[union-attr]
        other = w1 if holder is w0 else w0
        await answer(router, other, num_requests_waiting=1, worker_started_at=1000.0)
        assert router.pick("m", key=key(2)) is other
        other.in_flight = 1  # this gateway's own requests come first
        assert router.pick("m", key=key(3)) is holder

    run(test)


def test_a_known_key_spills_past_the_load_bound_and_stays_with_its_worker():
    async def test(router: Router) -> None:
        w0, w1 = router.workers
        w1.in_flight = 1  # the first pick goes to the idle w0
        assert router.pick("m", key=key("hot")) is w0
        w1.in_flight = 0
        w0.in_flight = 1  # 2 with this request; mean 1, bound ceil(1.25) = 2: still its own
        assert router.pick("m", key=key("hot")) is w0
        w0.in_flight = 2  # 3 with it; mean 1.5, bound ceil(1.875) = 2, but only 3 more than w1: still its own
        assert not over_bound(w0, [w0, w1])
        assert router.pick("m", key=key("hot")) is w0
        w0.in_flight = 4  # 5 with it; mean 2.5, bound ceil(3.125) = 4, and 5 more than w1: spills
        assert over_bound(w0, [w0, w1])
        assert router.pick("m", key=key("hot")) is w1
        assert router.prefix is not None and router.prefix.owner(key("hot")) == w0.name
        w0.in_flight = 0
        assert router.pick("m", key=key("hot")) is w0
        assert outcomes(router) == {"new": 1, "hit": 3, "spill": 1}

    run(test)


def test_one_hot_prefix_cannot_overload_one_worker():
    """40 requests of one prefix in flight at once: its worker takes them up to the bound, the
    rest spill, and neither worker runs more than 1.5x its share."""

    async def test(router: Router) -> None:
        for _ in range(40):
            router.pick("m", key=key("hot")).in_flight += 1
        loads = sorted(w.in_flight for w in router.workers)
        assert loads[0] > 0 and loads[1] <= 1.5 * 40 / 2, loads
        assert outcomes(router)["spill"] > 0

    run(test)


def test_one_worker_never_spills():
    async def test(router: Router) -> None:
        (w0,) = router.workers
        w0.in_flight = 50
        assert [router.pick("m", key=key("x")) for _ in range(3)] == [w0] * 3
        assert outcomes(router) == {"new": 1, "hit": 2}

    run(test, n=1)


@pytest.mark.parametrize("how", ["unhealthy", "draining", "retired"])
def test_a_key_moves_when_its_worker_is_gone(how: str):
    async def test(router: Router) -> None:
        w0, w1 = router.workers
        w1.in_flight = 1
        assert router.pick("m", key=key(1)) is w0
        w1.in_flight = 0
        if how == "unhealthy":
            router.report_failure(w0, "Generate failed: UNAVAILABLE")
        elif how == "draining":
            await answer(router, w0, draining=True, worker_started_at=1000.0)
        else:
            router.retire_worker(w0.name, "gone from DNS")
        assert not w0.healthy
        assert router.pick("m", key=key(1)) is w1
        assert router.prefix is not None and router.prefix.owner(key(1)) == w1.name
        await answer(router, w0, worker_started_at=1000.0)  # back (a retired one stays out)
        assert router.pick("m", key=key(1)) is w1  # the key stays where its prefix is now
        # (a retired worker's keys were forgotten at once: the key is new again)
        expected = {"new": 2, "hit": 1} if how == "retired" else {"new": 1, "fallback": 1, "hit": 1}
        assert outcomes(router) == expected
        assert dropped(router, "retired") == (1 if how == "retired" else 0)

    run(test)


def test_a_failover_never_goes_back_to_the_excluded_worker():
    async def test(router: Router) -> None:
        w0, w1 = router.workers
        w1.in_flight = 1
        assert router.pick("m", key=key(1)) is w0
        w1.in_flight = 5  # far busier, and still the only place to go
        assert router.pick("m", frozenset({w0}), key(1)) is w1
        assert router.prefix is not None and router.prefix.owner(key(1)) == w0.name  # w0 still holds it
        assert router.pick("m", frozenset({w0, w1}), key(1)) is None
        assert outcomes(router) == {"new": 1, "fallback": 1}

    run(test)


def test_a_restart_drops_the_keys_of_the_worker():
    async def test(router: Router) -> None:
        w0, w1 = router.workers
        owners = {i: router.pick("m", key=key(i)) for i in range(6)}
        mine = [i for i, w in owners.items() if w is w0]
        assert len(mine) == 3
        await answer(router, w0, worker_started_at=1000.0)  # the same process: nothing dropped
        assert router.prefix is not None and len(router.prefix) == 6
        await answer(router, w0, worker_started_at=2000.0)  # restarted: its cache is gone
        assert len(router.prefix) == 3 and dropped(router, "restart") == 3
        assert all(router.prefix.owner(key(i)) is None for i in mine)
        assert router.prefix.keys_of(w0.name) == 0 and router.prefix.keys_of(w1.name) == 3
        await answer(router, w1, worker_started_at=0.0)  # a worker that does not say: unknown, kept
        assert len(router.prefix) == 3

    run(test)


def test_the_table_keeps_the_most_recently_used_keys_within_its_size():
    async def test(router: Router) -> None:
        table = router.prefix
        assert table is not None
        for i in range(3):
            router.pick("m", key=key(i))
        router.pick("m", key=key(0))  # used: now the most recent
        router.pick("m", key=key(3))
        router.pick("m", key=key(4))
        assert len(table) == 3 and dropped(router, "evicted") == 2
        assert [table.owner(key(i)) is not None for i in range(5)] == [True, False, False, True, True]
        assert sum(table.keys_of(w.name) for w in router.workers) == 3
        assert router.metrics.registry.get_sample_value("draftwise_routing_keys") == 3

    run(test, prefix_max_keys=3)


def test_least_loaded_routing_keeps_no_table():
    async def test(router: Router) -> None:
        assert router.prefix is None
        w0, w1 = router.workers
        w0.in_flight = 1
        assert all(router.pick("m", key=key(1)) is w1 for _ in range(3))
        assert outcomes(router) == {}

    run(test, routing="least-loaded")


# --- what the polls export ------------------------------------------------------------------


def test_polls_export_the_workers_prefix_cache_counters():
    async def test(router: Router) -> None:
        w0, w1 = router.workers
        await answer(router, w0, prefix_cache_queries=640, prefix_cache_hits=512, num_cached_kv_blocks=40)
        text = prometheus_client.generate_latest(router.metrics.registry).decode()
        assert "# TYPE draftwise_prefix_cache_queries_total counter" in text
        assert f'draftwise_prefix_cache_queries_total{{worker="{w0.name}"}} 640.0' in text
        assert f'draftwise_prefix_cache_hits_total{{worker="{w0.name}"}} 512.0' in text
        assert f'draftwise_prefix_cache_hits_total{{worker="{w1.name}"}} 0.0' in text
        assert f'draftwise_kv_cached_blocks{{worker="{w0.name}"}} 40.0' in text
        router.metrics.forget_worker(w0.name)
        text = prometheus_client.generate_latest(router.metrics.registry).decode()
        assert w0.name not in text.split("draftwise_kv_cached_blocks gauge")[1].split("# HELP")[0]
        assert f'draftwise_prefix_cache_queries_total{{worker="{w0.name}"}}' not in text

    run(test)


# --- the request carries its salt and key through failovers ---------------------------------


def test_a_relay_sends_its_salt_and_key_and_keeps_them_on_continuations():
    async def main() -> None:
        metrics = GatewayMetrics()
        router = Router(ADDRESSES, metrics)
        core = Core(CONFIG, router, Admission(4, 250), metrics, "gw")
        try:
            for w in router.workers:
                await answer(router, w)
            start = pb.StartGeneration(prompt=pb.Prompt(text="a shared system prompt " * 40))
            relay = Relay(core, "r1", start, Admitted("m"), None, None, "tenant-salt")
            assert relay.request.cache_salt == "tenant-salt"
            assert relay.route_key == route_key(CONFIG, "tenant-salt", "m", start.prompt)
            first = pick(relay, {})
            assert first is not None
            relay.tokens.extend([5, 6])
            as_continuation(relay)
            assert relay.request.cache_salt == "tenant-salt"
            assert list(relay.request.start.continuation.output_token_ids) == [5, 6]
            assert pick(relay, {}) is first  # a resume goes back to the prefix's worker
            other = pick(relay, {first: first.channel})  # a failover does not
            assert other is not None and other is not first
        finally:
            await router.close()

    asyncio.run(main())
