"""Routing v1: each rule of MISSION M5.7 and each prefill_policy, on hand-built snapshots."""

from __future__ import annotations

import pytest

from crossfill.config import InferenceServiceConfig, NetworkConfig, RoutingConfig
from crossfill.policy import InstanceState, LinkState, NoRoute, RouteRequest, Snapshot, decide

CFG = InferenceServiceConfig(
    routing=RoutingConfig(long_context_threshold_tokens=1000),
    network=NetworkConfig(min_bandwidth_gbps=0.5, max_latency_ms=50),
)


def snap(local_q: int = 0, remote_q: int = 0, *, local_ok: bool = True, remote_ok: bool = True,
         link: LinkState | None = None, decode_q: int = 0, decode_ok: bool = True) -> Snapshot:
    return Snapshot(
        local_datacenter="here",
        instances=(
            InstanceState("here-prefill-0", "prefill", "here", healthy=local_ok, queue_depth=local_q, capacity=4),
            InstanceState("far-prefill-0", "prefill", "far", healthy=remote_ok, queue_depth=remote_q, capacity=4),
            InstanceState("here-decode-0", "decode", "here", healthy=decode_ok, queue_depth=decode_q, capacity=2),
        ),
        links=(link or LinkState("far", bandwidth_gbps=1.0, latency_ms=20),),
    )


def test_auto_short_prompt_stays_local() -> None:
    r = decide(RouteRequest(999), snap(), CFG)
    assert (r.kind, r.prefill, r.decode) == ("local", "here-prefill-0", "here-decode-0")
    assert r.degradation_reason is None


def test_auto_long_prompt_goes_remote_with_local_fallback() -> None:
    r = decide(RouteRequest(1000), snap(), CFG)
    assert (r.kind, r.prefill) == ("remote", "far-prefill-0")
    assert r.fallbacks == ("here-prefill-0",)


def test_no_local_fallback_when_disabled() -> None:
    cfg = CFG.model_copy(update={"routing": RoutingConfig(long_context_threshold_tokens=1000,
                                                          fallback_to_local_on_failure=False)})
    assert decide(RouteRequest(5000), snap(), cfg).fallbacks == ()


def test_auto_long_prompt_stays_local_when_remote_not_preferred() -> None:
    cfg = CFG.model_copy(update={"routing": RoutingConfig(long_context_threshold_tokens=1000,
                                                          prefer_remote_prefill=False)})
    r = decide(RouteRequest(5000), snap(), cfg)
    assert r.kind == "local" and r.degradation_reason is None


@pytest.mark.parametrize(
    "link, words",
    [
        (LinkState("far", bandwidth_gbps=0.1, latency_ms=20), "min_bandwidth_gbps"),
        (LinkState("far", bandwidth_gbps=1.0, latency_ms=80), "max_latency_ms"),
        (LinkState("far", up=False), "link down"),
    ],
)
def test_auto_long_prompt_unhealthy_link_degrades_to_local_with_reason(link: LinkState, words: str) -> None:
    r = decide(RouteRequest(5000), snap(link=link), CFG)
    assert r.kind == "local"
    assert r.degradation_reason is not None and words in r.degradation_reason


def test_auto_short_prompt_never_crosses_when_local_queue_full_unless_overflow_allowed() -> None:
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10), snap(local_q=4), CFG)
    assert e.value.status == 429 and "allow_short_overflow" in e.value.message
    cfg = CFG.model_copy(update={"routing": CFG.routing.model_copy(update={"allow_short_overflow": True})})
    r = decide(RouteRequest(10), snap(local_q=4), cfg)
    assert r.kind == "remote" and "overflow" in (r.degradation_reason or "")


def test_auto_long_prompt_overflows_to_remote_when_local_queue_full() -> None:
    r = decide(RouteRequest(5000), snap(local_q=4), CFG)
    assert r.kind == "remote"


def test_all_prefill_queues_full_is_429() -> None:
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10), snap(local_q=4, remote_q=4), CFG)
    assert e.value.status == 429 and e.value.code == "prefill_queue_full"


def test_local_only_never_crosses_datacenters() -> None:
    assert decide(RouteRequest(50_000, "local_only"), snap(), CFG).kind == "local"
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10, "local_only"), snap(local_ok=False), CFG)
    assert e.value.status == 503


def test_remote_required_fails_clearly_without_healthy_remote() -> None:
    r = decide(RouteRequest(10, "remote_required"), snap(), CFG)
    assert r.kind == "remote" and r.fallbacks == ()  # never silently local
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10, "remote_required"), snap(remote_ok=False), CFG)
    assert e.value.status == 503 and e.value.code == "no_remote_prefill"
    assert "remote" in e.value.message


def test_remote_preferred_falls_back_with_reason() -> None:
    assert decide(RouteRequest(10, "remote_preferred"), snap(), CFG).kind == "remote"
    r = decide(RouteRequest(10, "remote_preferred"), snap(remote_ok=False), CFG)
    assert r.kind == "local" and "no healthy remote" in (r.degradation_reason or "")


def test_decode_full_is_429_and_decode_down_is_503() -> None:
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10), snap(decode_q=2), CFG)
    assert e.value.status == 429
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10), snap(decode_ok=False), CFG)
    assert e.value.status == 503


def test_least_loaded_prefill_wins() -> None:
    s = Snapshot("here", instances=(
        InstanceState("here-prefill-0", "prefill", "here", queue_depth=3, capacity=4),
        InstanceState("here-prefill-1", "prefill", "here", queue_depth=1, capacity=4),
        InstanceState("here-decode-0", "decode", "here", capacity=2),
    ))
    r = decide(RouteRequest(10), s, CFG)
    assert r.prefill == "here-prefill-1" and r.fallbacks == ("here-prefill-0",)


def test_colocated_mode_uses_decode_instance() -> None:
    cfg = CFG.model_copy(update={"mode": "colocated"})
    r = decide(RouteRequest(50_000), snap(), cfg)
    assert r.kind == "local" and r.prefill == r.decode == "here-decode-0"


def test_unknown_policy_is_400() -> None:
    with pytest.raises(NoRoute) as e:
        decide(RouteRequest(10, "sometimes"), snap(), CFG)  # type: ignore[arg-type]
    assert e.value.status == 400


def test_pending_routes_spread_load_but_do_not_refuse() -> None:
    s = Snapshot("here", instances=(
        InstanceState("here-prefill-0", "prefill", "here", queue_depth=0, capacity=4, pending=6),
        InstanceState("here-prefill-1", "prefill", "here", queue_depth=1, capacity=4, pending=0),
        InstanceState("here-decode-0", "decode", "here", capacity=2, pending=5),
    ))
    assert decide(RouteRequest(10), s, CFG).prefill == "here-prefill-1"
    only = Snapshot("here", instances=(s.instances[0], s.instances[2]))
    assert decide(RouteRequest(10), only, CFG).prefill == "here-prefill-0"
