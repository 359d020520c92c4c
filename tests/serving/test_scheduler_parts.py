"""The scheduler's parts alone, with injected clocks: LinkWatch, BatchQueue, Retuner."""

from __future__ import annotations

import asyncio

import pytest
from serving_cluster import cluster_config

from crossfill.config import NetworkConfig, parse_config
from crossfill.policy import Defer, InstanceState, NoRoute, Route, Snapshot
from crossfill.serving.batch_queue import BatchQueue
from crossfill.serving.link_watch import LinkWatch
from crossfill.serving.retune import Retuner


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch(clock: Clock) -> LinkWatch:
    return LinkWatch("far", NetworkConfig(min_bandwidth_gbps=0.5, max_latency_ms=50), 1.0, expire_s=30,
                     egress_window_s=10, clock=clock)


def test_link_watch_counts_kv_in_flight_until_reported_or_expired() -> None:
    clock = Clock()
    w = watch(clock)
    w.routed("a", 1000)
    w.routed("b", 500)
    assert w.state().in_flight_bytes == 1500
    w.transferred("a", 900, 0.01, ok=True)
    assert w.state().in_flight_bytes == 500
    clock.now += 31  # b's report never came (decode died): it stops counting
    assert w.state().in_flight_bytes == 0


def test_link_watch_egress_rate_and_breaker_from_transfer_reports() -> None:
    clock = Clock()
    w = watch(clock)
    w.transferred(None, 5_000_000, 0.1, ok=True)
    w.transferred(None, 5_000_000, 0.1, ok=True)
    assert w.state().egress_bytes_per_s == pytest.approx(1_000_000)
    clock.now += 11
    assert w.state().egress_bytes_per_s == 0
    for _ in range(3):
        w.transferred(None, 0, 0.0, ok=False)
    assert w.state().breaker == "open"


def test_link_watch_admin_override_wins_and_below_minimum_is_unhealthy() -> None:
    w = watch(Clock())
    w.override_gbps = 0.1
    st = w.state()
    assert st.bandwidth_gbps == 0.1 and st.healthy is False and "min_bandwidth_gbps" in st.reason
    w.override_gbps = None
    assert w.state().healthy is True


def route(name: str) -> Route:
    return Route("remote", name, "d")


async def test_batch_queue_waits_for_capacity_heaviest_tenant_first() -> None:
    q = BatchQueue(max_waiting=10, max_wait_s=60)
    free = {"slots": 0}
    order: list[str] = []

    def attempt(tag: str):
        def run() -> Route:
            if free["slots"] == 0:
                raise Defer("no room")
            free["slots"] -= 1
            order.append(tag)
            return route(tag)
        return run

    light = asyncio.create_task(q.wait(1.0, attempt("light")))
    heavy = asyncio.create_task(q.wait(5.0, attempt("heavy")))
    await asyncio.sleep(0)
    assert q.retry() == 0 and len(q) == 2
    free["slots"] = 1
    assert q.retry() == 1
    assert (await heavy).prefill == "heavy" and order == ["heavy"]
    free["slots"] = 1
    q.retry()
    assert (await light).prefill == "light"
    assert len(q) == 0


async def test_batch_queue_full_timeout_and_refusal_are_explicit() -> None:
    def never() -> Route:
        raise Defer("no room")

    # Full: a wait long enough that no delay of a loaded machine ends the first waiter first.
    full = BatchQueue(max_waiting=1, max_wait_s=3600)
    waiting = asyncio.create_task(full.wait(1.0, never))
    await asyncio.sleep(0)
    with pytest.raises(NoRoute) as e:
        await full.wait(1.0, never)
    assert e.value.code == "batch_queue_full"
    waiting.cancel()
    # Timeout: waited for, whatever it takes the loop to get there.
    with pytest.raises(NoRoute) as e:
        await BatchQueue(max_waiting=1, max_wait_s=0.01).wait(1.0, never)
    assert e.value.code == "batch_queue_timeout"

    def refused() -> Route:
        raise NoRoute(503, "no_decode_instance", "gone")

    q2 = BatchQueue(max_waiting=5, max_wait_s=60)
    t = asyncio.create_task(q2.wait(1.0, refused))
    await asyncio.sleep(0)
    q2.retry()
    with pytest.raises(NoRoute) as e:
        await t
    assert e.value.code == "no_decode_instance"


def retune_cfg(pin: bool):
    doc = cluster_config(".", 20000, routing={"long_context_threshold_tokens": 64, "pin_threshold": pin})
    return parse_config(doc)


def snapshot(local_tps: float, remote_tps: float) -> Snapshot:
    return Snapshot("here", (
        InstanceState("here-prefill-0", "prefill", "here", capacity=4, prefill_tokens_per_s=local_tps),
        InstanceState("far-prefill-0", "prefill", "far", capacity=4, prefill_tokens_per_s=remote_tps),
        InstanceState("here-decode-0", "decode", "here", capacity=8),
    ), kv_bytes_per_token=1000.0)


def test_retuner_waits_for_samples_then_derives_a_threshold_from_the_traffic() -> None:
    r = Retuner(retune_cfg(pin=False), min_samples=50)
    assert "waiting" in r.retune(snapshot(1000, 1000), 1.0)["status"] and r.live_threshold() is None
    for i in range(400):
        r.observe(32 + (i % 20) * 50, i * 0.1)  # 32 .. 982 tokens, 10 requests/s
    plan = r.retune(snapshot(1000, 1000), 1.0)
    assert plan["status"] == "ok", plan
    t = r.live_threshold()
    # Equal pools: the throughput-optimal split sends part of the traffic, not none nor all.
    assert t is not None and 32 < t <= 982 and 0 < plan["live"]["offload_share"] < 1, plan["live"]
    rec = plan["recommended"]
    assert rec["arrival_rate_rps"] == pytest.approx(10, rel=0.01)
    assert rec["local_prefill_instances"] >= 1 and rec["remote_prefill_instances"] >= 1, rec
    # A remote pool 10x faster takes more of the traffic: the threshold goes down.
    r.retune(snapshot(1000, 10_000), 1.0)
    assert r.live_threshold() < t


def test_pinned_threshold_is_never_replaced() -> None:
    r = Retuner(retune_cfg(pin=True), min_samples=10)
    for i in range(100):
        r.observe(100 + i, float(i))
    assert r.retune(snapshot(1000, 1000), 1.0)["status"] == "ok"
    assert r.live_threshold() is None  # the policy keeps routing.long_context_threshold_tokens
