"""Routing v2 (M5.7): each dimension flips a decision when only that input changes, plus properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfill.config import InferenceServiceConfig, NetworkConfig, RoutingConfig, TenantRoutingConfig
from crossfill.policy import Defer, InstanceState, LinkState, NoRoute, RouteRequest, Snapshot, decide

ROUTING = RoutingConfig(long_context_threshold_tokens=1000, pin_threshold=True, assumed_prefill_tokens_per_s=1000)
CFG = InferenceServiceConfig(routing=ROUTING, network=NetworkConfig(min_bandwidth_gbps=0.1, max_latency_ms=50))
BPT = 50_000.0  # KV wire bytes per token (~SmolLM2 fp32)


def cfg(**routing: object) -> InferenceServiceConfig:
    return CFG.model_copy(update={"routing": ROUTING.model_copy(update=routing)})


def snap(*, link: LinkState | None = None, local_q: int = 0, remote_q: int = 0, capacity: int = 4,
         bpt: float | None = BPT, threshold: int | None = None, remotes: int = 1) -> Snapshot:
    instances = [InstanceState("here-prefill-0", "prefill", "here", queue_depth=local_q, capacity=capacity)]
    instances += [InstanceState(f"far-prefill-{i}", "prefill", "far", queue_depth=remote_q, capacity=capacity)
                  for i in range(remotes)]
    instances += [InstanceState("here-decode-0", "decode", "here", capacity=8),
                  InstanceState("here-decode-1", "decode", "here", capacity=8)]
    return Snapshot("here", tuple(instances), (link or LinkState("far", bandwidth_gbps=10.0, latency_ms=5),),
                    kv_bytes_per_token=bpt, threshold_tokens=threshold)


# -- one test per dimension: change one input, the decision flips ---------------------------------

def test_incremental_length_cached_on_local_prefill_is_not_counted_against_the_threshold() -> None:
    assert decide(RouteRequest(1500), snap(), CFG).kind == "remote"
    r = decide(RouteRequest(1500, cached_tokens={"here-prefill-0": 800}), snap(), CFG)
    assert r.kind == "local" and "700 uncached tokens" in r.reason and r.prefill_cached_tokens == 800
    # Cached only in the remote pool, it is still long here, and goes where it is cached.
    assert decide(RouteRequest(1500, cached_tokens={"far-prefill-0": 800}), snap(), CFG).kind == "remote"


def test_incremental_length_held_by_decode_is_not_counted() -> None:
    r = decide(RouteRequest(1500, cached_tokens={"here-decode-0": 1200}), snap(), CFG)
    assert r.kind == "local" and r.decode == "here-decode-0" and r.decode_held_tokens == 1200


def test_kv_present_picks_the_prefill_instance_holding_the_prefix() -> None:
    s = snap(remotes=2)
    assert decide(RouteRequest(5000), s, CFG).prefill == "far-prefill-0"  # tie: by name
    r = decide(RouteRequest(5000, cached_tokens={"far-prefill-1": 3000}), s, CFG)
    assert r.prefill == "far-prefill-1" and r.prefill_cached_tokens == 3000


def test_kv_present_follow_up_turn_goes_to_the_decode_holding_its_history() -> None:
    assert decide(RouteRequest(300), snap(), CFG).decode == "here-decode-0"
    assert decide(RouteRequest(300, cached_tokens={"here-decode-1": 256}), snap(), CFG).decode == "here-decode-1"


def test_bandwidth_slow_link_keeps_long_prompts_local() -> None:
    assert decide(RouteRequest(5000), snap(), CFG).kind == "remote"
    r = decide(RouteRequest(5000), snap(link=LinkState("far", bandwidth_gbps=0.2, latency_ms=5)), CFG)
    assert r.kind == "local" and "no faster than local prefill" in r.reason


def test_bandwidth_bytes_in_flight_back_off() -> None:
    busy = LinkState("far", bandwidth_gbps=10.0, latency_ms=5, in_flight_bytes=int(10e9 / 8 * 6))  # 6 s queued
    r = decide(RouteRequest(5000), snap(link=busy), CFG)
    assert r.kind == "local" and "kept local" in r.reason


def test_bandwidth_gate_can_be_switched_off() -> None:
    slow = snap(link=LinkState("far", bandwidth_gbps=0.2, latency_ms=5))
    assert decide(RouteRequest(5000), slow, cfg(bandwidth_aware=False)).kind == "remote"


def test_link_health_breaker_open_and_unhealthy_keep_it_local() -> None:
    for link in (LinkState("far", bandwidth_gbps=10.0, breaker="open"),
                 LinkState("far", bandwidth_gbps=10.0, healthy=False, reason="one-way latency 80 ms > max")):
        r = decide(RouteRequest(5000), snap(link=link), CFG)
        assert r.kind == "local" and r.degradation_reason
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(5000, "remote_required"), snap(link=LinkState("far", breaker="half_open")), CFG)
    assert e.value.status == 503 and "circuit breaker" in e.value.message


def test_request_type_batch_never_uses_local_prefill_while_a_remote_pool_exists() -> None:
    assert decide(RouteRequest(100), snap(), CFG).kind == "local"
    assert decide(RouteRequest(100, request_type="batch"), snap(), CFG).kind == "remote"
    with pytest.raises(Defer):
        decide(RouteRequest(100, request_type="batch"), snap(remote_q=2), CFG)  # 2 of 4 = batch share


def test_tenant_setting_makes_requests_batch() -> None:
    c = cfg(tenants={"nightly": TenantRoutingConfig(request_type="batch")})
    assert decide(RouteRequest(100, tenant_id="nightly"), snap(), c).request_type == "batch"
    assert decide(RouteRequest(100, tenant_id="nightly", request_type="interactive"), snap(), c).kind == "local"


def test_tier_premium_uses_the_reserved_local_share() -> None:
    c = cfg(reserved_premium_share=0.5, tenants={"vip": TenantRoutingConfig(tier="premium")})
    with pytest.raises(NoRoute):
        decide(RouteRequest(100, tenant_id="someone"), snap(local_q=2), c)
    assert decide(RouteRequest(100, tenant_id="vip"), snap(local_q=2), c).kind == "local"


def test_short_prompts_never_cross_when_local_is_full_unless_overflow_allowed() -> None:
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(100), snap(local_q=4), CFG)
    assert e.value.status == 429
    assert decide(RouteRequest(100), snap(local_q=4), cfg(allow_short_overflow=True)).kind == "remote"


def test_cost_weight_of_the_remote_datacenter() -> None:
    link = LinkState("far", bandwidth_gbps=1.0, latency_ms=5)  # 2500 tok/s of KV vs 1000 tok/s local
    assert decide(RouteRequest(5000), snap(link=link), CFG).kind == "remote"
    r = decide(RouteRequest(5000), snap(link=link), cfg(cost_weights={"far": 3.0}))
    assert r.kind == "local" and "cost weight 3" in r.reason


def test_egress_budget() -> None:
    link = LinkState("far", bandwidth_gbps=10.0, latency_ms=5, egress_bytes_per_s=200e6)
    assert decide(RouteRequest(5000), snap(link=link), CFG).kind == "remote"
    r = decide(RouteRequest(5000), snap(link=link), cfg(egress_budget_bytes_per_s=100e6))
    assert r.kind == "local" and "egress budget" in r.reason


def test_live_threshold_is_used_unless_pinned() -> None:
    assert decide(RouteRequest(1500), snap(threshold=2000), cfg(pin_threshold=False)).kind == "local"
    assert decide(RouteRequest(1500), snap(threshold=2000), cfg(pin_threshold=True)).kind == "remote"


def test_unknown_request_type_is_400_naming_it() -> None:
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10, request_type="bulk"), snap(), CFG)  # type: ignore[arg-type]
    assert e.value.status == 400 and "request_type" in e.value.message


# -- properties ------------------------------------------------------------------------------------

links = st.builds(
    LinkState, st.just("far"),
    bandwidth_gbps=st.one_of(st.none(), st.floats(0.05, 100)),
    latency_ms=st.one_of(st.none(), st.floats(0, 100)),
    up=st.booleans(),
    healthy=st.one_of(st.none(), st.booleans()),
    breaker=st.sampled_from(["closed", "open", "half_open"]),
    in_flight_bytes=st.integers(0, 10**10),
    egress_bytes_per_s=st.floats(0, 1e9),
)


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    def inst(name: str, role: str, dc: str) -> InstanceState:
        cap = draw(st.integers(1, 8))
        return InstanceState(name, role, dc, healthy=draw(st.booleans()), ready=draw(st.booleans()),  # type: ignore[arg-type]
                             queue_depth=draw(st.integers(0, cap)), capacity=cap, pending=draw(st.integers(0, 4)),
                             prefill_tokens_per_s=draw(st.one_of(st.none(), st.floats(50, 1e5))))
    instances = [inst(f"here-prefill-{i}", "prefill", "here") for i in range(draw(st.integers(0, 2)))]
    instances += [inst(f"far-prefill-{i}", "prefill", "far") for i in range(draw(st.integers(0, 2)))]
    instances += [inst(f"here-decode-{i}", "decode", "here") for i in range(draw(st.integers(1, 2)))]
    return Snapshot("here", tuple(instances), (draw(links),),
                    kv_bytes_per_token=draw(st.one_of(st.none(), st.floats(100, 1e6))),
                    threshold_tokens=draw(st.one_of(st.none(), st.integers(1, 10_000))))


configs = st.builds(
    lambda bw, egress, weight, overflow, pin: cfg(bandwidth_aware=bw, egress_budget_bytes_per_s=egress,
                                                 cost_weights={"far": weight}, allow_short_overflow=overflow,
                                                 pin_threshold=pin),
    st.booleans(), st.one_of(st.none(), st.floats(1e6, 1e9)), st.floats(0, 4), st.booleans(), st.booleans())
cached = st.dictionaries(st.sampled_from(["here-prefill-0", "far-prefill-0", "far-prefill-1", "here-decode-0"]),
                         st.integers(0, 5000), max_size=3)


def outcome(req: RouteRequest, s: Snapshot, c: InferenceServiceConfig) -> str:
    try:
        return decide(req, s, c).kind
    except Defer:
        return "deferred"
    except NoRoute as exc:
        return f"refused {exc.status}"


@settings(max_examples=400, deadline=None)
@given(snapshots(), configs, st.integers(0, 20_000), cached, st.sampled_from(["interactive", "batch"]))
def test_local_only_never_routes_remote(s: Snapshot, c: InferenceServiceConfig, n: int, ct: dict[str, int],
                                        rtype: str) -> None:
    assert outcome(RouteRequest(n, "local_only", request_type=rtype, cached_tokens=ct), s, c) != "remote"  # type: ignore[arg-type]


@settings(max_examples=400, deadline=None)
@given(snapshots(), configs, st.integers(0, 20_000), cached,
       st.sampled_from(["auto", "remote_preferred", "remote_required"]), st.sampled_from(["interactive", "batch"]))
def test_nothing_crosses_a_link_whose_breaker_is_open(s: Snapshot, c: InferenceServiceConfig, n: int,
                                                      ct: dict[str, int], policy: str, rtype: str) -> None:
    s = dataclasses.replace(s, links=tuple(dataclasses.replace(lk, breaker="open") for lk in s.links))
    assert outcome(RouteRequest(n, policy, request_type=rtype, cached_tokens=ct), s, c) != "remote"  # type: ignore[arg-type]


@settings(max_examples=600, deadline=None)
@given(snapshots(), configs, st.integers(0, 20_000), st.integers(1, 5_000), cached)
def test_more_uncached_tokens_never_move_a_request_from_remote_to_local(
        s: Snapshot, c: InferenceServiceConfig, n: int, more: int, ct: dict[str, int]) -> None:
    if outcome(RouteRequest(n, cached_tokens=ct), s, c) == "remote":
        assert outcome(RouteRequest(n + more, cached_tokens=ct), s, c) != "local"


@settings(max_examples=400, deadline=None)
@given(snapshots(), configs, st.integers(0, 20_000), st.integers(0, 20_000), cached)
def test_a_batch_request_never_displaces_an_interactive_one(
        s: Snapshot, c: InferenceServiceConfig, n_batch: int, n: int, ct: dict[str, int]) -> None:
    """Whatever an interactive request would get, it still gets once a batch request was admitted.

    The batch request is counted as real load (queue_depth + 1 where it went), not as `pending`,
    which never refuses: it must only ever take capacity interactive requests do not need.
    """
    before = outcome(RouteRequest(n, cached_tokens=ct), s, c)
    try:
        b = decide(RouteRequest(n_batch, request_type="batch"), s, c)
    except NoRoute:
        return
    assert b.kind == "remote" or not any(i.role == "prefill" and i.datacenter != "here" for i in s.instances)
    after_batch = dataclasses.replace(s, instances=tuple(
        dataclasses.replace(i, queue_depth=i.queue_depth + 1) if i.name == b.prefill else i
        for i in s.instances))
    after = outcome(RouteRequest(n, cached_tokens=ct), after_batch, c)
    assert after == before, (b, before, after)
