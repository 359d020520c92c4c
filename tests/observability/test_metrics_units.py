"""The parts of the M5.10 metrics and request log that need no cluster, each on its real inputs.

- routing decisions get a bounded rule label for every sentence the real policy writes;
- the KV receiver's refusals (a real TCP receiver refusing a corrupted frame) become
  `crossfill_kv_checksum_failures_total` and `crossfill_kv_frames_refused_total{reason}`;
- a link's estimates (a real `LinkWatch` fed samples on an injected clock) become gauges, with
  utilisation = egress / capacity;
- CPU "accelerator" utilisation and memory, tenant labels bounded by the config;
- the request log writes one JSON object per line at the level the config sets.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from pathlib import Path

import pytest
from kv.helpers import FINGERPRINT, Collector, FlipProxy, build_manifest, expectation, hybrid_specs, make_kv
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serving.serving_cluster import cluster_config

from crossfill.config import CrossfillConfig, InferenceServiceConfig, NetworkConfig, RoutingConfig
from crossfill.engine.types import LayerKVChunk
from crossfill.kv.tcp import KVReceiver, KVSender
from crossfill.kv.wire import MsgType, manifest_body, message, token_digest
from crossfill.observability import request_log
from crossfill.observability.collectors import ClusterCollector, ReceiverCollector
from crossfill.observability.metrics_defs import TenantLabels
from crossfill.observability.process import AcceleratorCollector
from crossfill.observability.request_log import RequestLog
from crossfill.observability.route_reasons import reason_label
from crossfill.policy import InstanceState, LinkState, RouteRequest, Snapshot, decide
from crossfill.serving.link_watch import LinkWatch
from crossfill.serving.protocol import RouteInfo


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `registry`'s text exposition, parsed by prometheus_client's own parser."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return samples(registry).get((name, tuple(sorted(labels.items()))))


# -- routing rule labels ----------------------------------------------------------------------

CFG = InferenceServiceConfig(routing=RoutingConfig(long_context_threshold_tokens=1000),
                             network=NetworkConfig(min_bandwidth_gbps=0.5, max_latency_ms=50))


def _snap(link: LinkState | None = None) -> Snapshot:
    return Snapshot("here", instances=(
        InstanceState("here-prefill-0", "prefill", "here", capacity=4),
        InstanceState("far-prefill-0", "prefill", "far", capacity=4),
        InstanceState("here-decode-0", "decode", "here", capacity=2),
    ), links=(link or LinkState("far", bandwidth_gbps=1.0, latency_ms=20),))


def _cfg(**update: object) -> InferenceServiceConfig:
    return CFG.model_copy(update=update)


@pytest.mark.parametrize("req, snap, cfg, label", [
    (RouteRequest(999), _snap(), CFG, "short_prompt"),
    (RouteRequest(5000), _snap(), CFG, "long_prompt"),
    (RouteRequest(5000), _snap(), _cfg(routing=RoutingConfig(long_context_threshold_tokens=1000,
                                                             prefer_remote_prefill=False)), "prefer_local"),
    (RouteRequest(5000), _snap(LinkState("far", up=False)), CFG, "long_prompt_remote_unavailable"),
    (RouteRequest(10, "local_only"), _snap(), CFG, "policy_local_only"),
    (RouteRequest(10, "remote_required"), _snap(), CFG, "policy_remote_required"),
    (RouteRequest(10, "remote_preferred"), _snap(), CFG, "policy_remote_preferred"),
    (RouteRequest(10, request_type="batch"), _snap(), CFG, "batch_remote"),
    (RouteRequest(50_000), _snap(), _cfg(mode="colocated"), "colocated"),
])
def test_every_policy_sentence_gets_its_rule_label(req: RouteRequest, snap: Snapshot,
                                                   cfg: InferenceServiceConfig, label: str) -> None:
    route = decide(req, snap, cfg)
    assert reason_label(route.reason) == label, route.reason


def test_an_unknown_sentence_is_other_never_the_sentence_itself() -> None:
    assert reason_label("auto: prompt 17 tokens, a rule nobody wrote") == "other"


# -- KV receiver ------------------------------------------------------------------------------

async def test_a_corrupted_frame_payload_is_a_checksum_failure_on_metrics() -> None:
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, 120)
    m = build_manifest(specs, 120)
    registry = CollectorRegistry()
    async with KVReceiver() as rx:
        registry.register(ReceiverCollector(rx.counters))
        assert value(registry, "crossfill_kv_checksum_failures_total") == 0
        rx.expect(expectation(m.cache_id, Collector(), fingerprint=FINGERPRINT, token_digest=token_digest(range(120)),
                              tenant="tenant-a"))
        flip_at = len(message(MsgType.MANIFEST, manifest_body(m))) + 200  # inside frame 0's payload
        async with FlipProxy(rx.port, flip_at) as proxy, KVSender(proxy.endpoint, connections=1).open(m) as tx:
            for layer in sorted(kv):
                await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
            await tx.commit()
        await rx.wait(m.cache_id)
    assert value(registry, "crossfill_kv_checksum_failures_total") == 1
    assert value(registry, "crossfill_kv_integrity_failures_total") == 1
    assert value(registry, "crossfill_kv_frames_refused_total", reason="checksum") == 1
    assert value(registry, "crossfill_kv_frames_received_total", result="refused") == 1
    assert value(registry, "crossfill_kv_frames_received_total", result="accepted") == m.frame_count
    assert value(registry, "crossfill_kv_receiver_transfers_total", result="completed") == 1


# -- links, as the scheduler sees them --------------------------------------------------------

def test_link_estimates_and_utilisation_are_gauges_labelled_by_link() -> None:
    now = [100.0]
    link = LinkWatch("far", NetworkConfig(min_bandwidth_gbps=0.05, max_latency_ms=50), configured_gbps=1.0,
                     egress_window_s=10.0, clock=lambda: now[0])
    link.monitor.record_rtt(0.010)
    link.transferred("r1", 12_500_000, 0.5, True, frames=10, retransmitted=2)  # 12.5 MB in the last 10 s
    registry = CollectorRegistry()
    registry.register(ClusterCollector(lambda: {"far": link}, list, dict))
    assert value(registry, "crossfill_link_rtt_seconds", link="far") == pytest.approx(0.010)
    assert value(registry, "crossfill_link_capacity_bytes_per_second", link="far") == pytest.approx(1.25e8)
    assert value(registry, "crossfill_link_egress_bytes_per_second", link="far") == pytest.approx(1.25e6)
    assert value(registry, "crossfill_link_utilization_ratio", link="far") == pytest.approx(0.01)
    assert value(registry, "crossfill_link_retransmit_ratio", link="far") == pytest.approx(0.2)
    assert value(registry, "crossfill_link_breaker_state", link="far", state="closed") == 1
    link.override_gbps = 0.1  # the operator's capacity wins over the configured one
    assert value(registry, "crossfill_link_utilization_ratio", link="far") == pytest.approx(0.1)
    now[0] += 11  # the transfer left the egress window
    assert value(registry, "crossfill_link_utilization_ratio", link="far") == 0


# -- process ----------------------------------------------------------------------------------

def test_cpu_utilisation_is_cpu_time_over_wall_time_and_cores() -> None:
    now = [0.0]
    registry = CollectorRegistry()
    registry.register(AcceleratorCollector(clock=lambda: now[0]))
    value(registry, "crossfill_accelerator_utilization_ratio", device="cpu")  # the baseline
    busy_until = time.process_time() + 0.1
    while time.process_time() < busy_until:  # at least 0.1 s of CPU time in a (clock) second
        pass
    now[0] += 1.0
    util = value(registry, "crossfill_accelerator_utilization_ratio", device="cpu")
    # Half the CPU time spent, as a margin for the OS's tick-grained CPU accounting and float error.
    assert util is not None and util >= 0.05 / len(os.sched_getaffinity(0))
    now[0] += 0.5  # a second scraper half a second later shares the window: the same value
    assert value(registry, "crossfill_accelerator_utilization_ratio", device="cpu") == util
    used = value(registry, "crossfill_accelerator_memory_used_bytes", device="cpu")
    total = value(registry, "crossfill_accelerator_memory_total_bytes", device="cpu")
    assert used is not None and total is not None and 0 < used < total


def test_tenant_label_values_are_the_configured_tenants_none_or_other() -> None:
    doc = cluster_config(Path("model"), 30000)
    doc["inference_service"]["routing"]["tenants"] = {"gold": {}}
    doc["inference_service"]["observability"]["metric_tenants"] = ["acme"]
    doc["security"]["limits"] = {"tenants": {"capped": {}}}
    doc["security"]["auth"]["dev_keys"] = [{"key": "k" * 16, "tenant": "keyed"}]
    cfg = CrossfillConfig.model_validate(doc)
    label = TenantLabels(cfg)
    assert [label(t) for t in ("gold", "acme", "capped", "keyed", None, "", "random-123")] == \
        ["gold", "acme", "capped", "keyed", "none", "none", "other"]


# -- request log ------------------------------------------------------------------------------

TEN_FIELDS = ("request_id", "tenant_id", "routing_path", "prefill_instance", "decode_instance", "cache_id",
              "durations_ms", "error_code", "retry_count", "degradation_reason")


@pytest.fixture
def captured() -> io.StringIO:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(request_log.JSONLineFormatter())
    request_log.log.addHandler(handler)
    root_level = logging.getLogger().level
    yield out
    logging.getLogger().setLevel(root_level)
    request_log.log.removeHandler(handler)


def test_one_json_line_with_the_ten_fields_at_the_configured_level(captured: io.StringIO) -> None:
    rl = RequestLog("decode", "here-decode-0")
    info = RouteInfo(request_id="r-1", route="remote", prefill_instance="far-prefill-0",
                     decode_instance="here-decode-0", cache_id="r-1.abc", timings_ms={"prefill": 12.34}, retries=1,
                     tenant_id="acme", degradation_reason=None, trace_id="t" * 32)
    logging.getLogger().setLevel(logging.WARNING)  # observability.log_level: warning
    rl.emit("decode", info, status="ok")
    assert captured.getvalue() == ""  # a finished request is an info line
    rl.emit("decode", info, status="error", error_code="engine_error", error="500 engine error: boom")
    logging.getLogger().setLevel(logging.INFO)
    rl.emit("decode", info, status="ok", output_tokens=7)
    lines = captured.getvalue().splitlines()
    assert len(lines) == 2
    err, ok = (json.loads(line) for line in lines)
    for line in (err, ok):
        assert set(TEN_FIELDS) <= set(line)
        assert (line["service"], line["instance"], line["stage"]) == ("decode", "here-decode-0", "decode")
        assert line["routing_path"] == "remote: far-prefill-0 -> here-decode-0"
        assert line["durations_ms"] == {"prefill": 12.3} and line["retry_count"] == 1
        assert line["trace_id"] == "t" * 32
    assert (err["level"], err["status"], err["error_code"]) == ("warning", "error", "engine_error")
    assert (ok["level"], ok["status"], ok["error_code"], ok["output_tokens"]) == ("info", "ok", None, 7)
