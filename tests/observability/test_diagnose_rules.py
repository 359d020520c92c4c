"""M8's table, rule by rule, on snapshots built here (no cluster): healthy says nothing, each symptom
is named by its own rule (and by no other), with the numbers it saw as evidence."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from crossfill.observability.diagnose import parse_metrics, report
from crossfill.observability.diagnose_rules import RULES, Facts, Service, Snapshot, Window, evaluate

FACTS = Facts(threshold_tokens=256, compression_enabled=True, max_retry=2, timeout_ms=8000)
ROLES = {"gateway": "gateway", "scheduler": "scheduler", "here-prefill-0": "prefill", "far-prefill-0": "prefill",
         "here-decode-0": "decode"}


def _healthy_metrics() -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """Counters of a cluster that served local and long remote requests, nothing wrong."""
    m: dict[str, dict] = {name: {} for name in ROLES}
    m["gateway"][("crossfill_requests_total", (("outcome", "ok"), ("route", "local")))] = 100
    m["gateway"][("crossfill_requests_total", (("outcome", "ok"), ("route", "remote")))] = 40
    m["gateway"][("crossfill_request_prompt_tokens_total", (("route", "remote"), ("tenant", "none")))] = 40 * 2000
    m["gateway"][("crossfill_errors_total", (("code", "context_length_exceeded"),))] = 2
    m["scheduler"][("crossfill_routing_decisions_total", (("reason", "long_prompt"), ("route", "remote")))] = 40
    m["here-decode-0"][("crossfill_kv_raw_bytes_total", ())] = 4e8
    m["here-decode-0"][("crossfill_kv_wire_bytes_total", ())] = 1e8
    m["here-decode-0"][("crossfill_kv_retries_total", ())] = 0
    m["here-decode-0"][("crossfill_kv_checksum_failures_total", ())] = 0
    for name, side in (("far-prefill-0", "prefill"), ("here-prefill-0", "prefill"), ("here-decode-0", "decode")):
        m[name][("crossfill_prefix_cache_query_tokens_total", (("side", side),))] = 100_000
        m[name][("crossfill_prefix_cache_hit_tokens_total", (("side", side),))] = 40_000
    return m


def _healthy_cluster() -> dict[str, Any]:
    inst = {"healthy": True, "ready": True, "state": "active", "queue_depth": 1, "failures": 0, "last_error": None}
    return {
        "threshold_tokens": 256,
        "instances": {
            "here-prefill-0": {**inst, "role": "prefill", "capacity": 16},
            "far-prefill-0": {**inst, "role": "prefill", "capacity": 16},
            "here-decode-0": {**inst, "role": "decode", "capacity": 32,
                              "kv": {"blocks_total": 1000, "blocks_used": 200}},
        },
        "links": {"far": {"usable": True, "healthy": True, "up": True, "breaker": "closed", "rtt_ms": 40.0,
                          "bandwidth_gbps": 1.0, "configured_bandwidth_gbps": 1.0, "loss_rate": 0.0,
                          "egress_bytes_per_s": 1e6, "transfers_ok": 40, "transfers_failed": 0, "reason": ""}},
    }


def _snap(t: float, metrics: dict, cluster: dict | None, facts: Facts = FACTS,
          stats: dict[str, dict] | None = None) -> Snapshot:
    services = {}
    for name, role in ROLES.items():
        samples = tuple((n, dict(lb), float(v)) for (n, lb), v in metrics.get(name, {}).items())
        services[name] = Service(name, role, "far" if name.startswith("far") else "here", samples,
                                 (stats or {}).get(name))
    return Snapshot(t, services, cluster, {"status": "waiting for 100 requests (seen 3)"}, facts)


class Scene:
    """Two snapshots 5 s apart; a test changes the later one into its symptom."""

    def __init__(self) -> None:
        self.metrics_before, self.cluster_before = _healthy_metrics(), _healthy_cluster()
        self.metrics, self.cluster = copy.deepcopy(self.metrics_before), copy.deepcopy(self.cluster_before)
        self.facts = FACTS
        self.stats: dict[str, dict] = {}

    def add(self, service: str, name: str, labels: dict[str, str], by: float) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.metrics[service][key] = self.metrics[service].get(key, 0) + by

    def window(self) -> Window:
        return Window(_snap(1005.0, self.metrics, self.cluster, self.facts, self.stats),
                      _snap(1000.0, self.metrics_before, self.cluster_before, self.facts))

    def findings(self) -> dict[str, tuple[str, ...]]:
        return {f.rule.id: f.evidence for f in evaluate(self.window())}


def test_a_healthy_cluster_has_no_finding() -> None:
    assert Scene().findings() == {}


def test_a_healthy_cluster_read_once_has_no_finding() -> None:
    w = Window(_snap(1000.0, _healthy_metrics(), _healthy_cluster()))
    assert evaluate(w) == []


def _link(s: Scene, **changes: Any) -> None:
    s.cluster["links"]["far"].update(changes)


def _slow_link(s: Scene) -> None:
    _link(s, usable=False, healthy=False, rtt_ms=210.0,
          reason="latency 105 ms one way > max_latency_ms 50")


def _saturated_link(s: Scene) -> None:
    _link(s, egress_bytes_per_s=0.95e9 / 8)


def _corruption(s: Scene) -> None:
    s.add("here-decode-0", "crossfill_kv_checksum_failures_total", {}, 3)
    s.add("here-decode-0", "crossfill_kv_retries_total", {}, 3)
    _link(s, transfers_failed=3)


def _prefill_backlog(s: Scene) -> None:
    s.cluster["instances"]["far-prefill-0"]["queue_depth"] = 16
    s.add("scheduler", "crossfill_errors_total", {"code": "prefill_queue_full"}, 7)


def _decode_full(s: Scene) -> None:
    s.stats["here-decode-0"] = {"queue_depth": 32, "capacity": 32, "kv": {"blocks_total": 1000, "blocks_used": 1000}}
    s.add("scheduler", "crossfill_errors_total", {"code": "decode_full"}, 4)


def _decode_silent(s: Scene) -> None:
    s.add("gateway", "crossfill_errors_total", {"code": "decode_silent"}, 2)
    s.add("gateway", "crossfill_fallbacks_total", {"reason": "reschedule"}, 2)


def _short_remote(s: Scene) -> None:
    s.add("gateway", "crossfill_requests_total", {"outcome": "ok", "route": "remote"}, 10)
    s.add("gateway", "crossfill_request_prompt_tokens_total", {"route": "remote", "tenant": "none"}, 10 * 40)
    s.add("scheduler", "crossfill_routing_decisions_total", {"reason": "policy_remote_required", "route": "remote"}, 10)


def _uncompressed_busy(s: Scene) -> None:
    s.facts = Facts(threshold_tokens=256, compression_enabled=False)
    s.add("here-decode-0", "crossfill_kv_raw_bytes_total", {}, 3e8)
    s.add("here-decode-0", "crossfill_kv_wire_bytes_total", {}, 3e8)
    _link(s, egress_bytes_per_s=0.6e9 / 8)


def _low_hit_rate(s: Scene) -> None:
    s.add("far-prefill-0", "crossfill_prefix_cache_query_tokens_total", {"side": "prefill"}, 200_000)
    s.add("far-prefill-0", "crossfill_prefix_cache_hit_tokens_total", {"side": "prefill"}, 1_000)


def _instance_down(s: Scene) -> None:
    s.cluster["instances"]["here-prefill-0"].update(healthy=False, failures=5, last_error="ConnectError: refused")


SYMPTOMS = {
    "link_slow": (_slow_link, "RTT 210.0 ms"),
    "link_saturated": (_saturated_link, "95%"),
    "kv_transfer_failures": (_corruption, "3 KV frame(s) failed their checksum in 5.0 s"),
    "prefill_backlog": (_prefill_backlog, "far-prefill-0 queue 16/16"),
    "decode_full": (_decode_full, "4 request(s) refused with decode_full"),
    "decode_silent": (_decode_silent, "found decode silent 2 time(s)"),
    "short_prompts_remote": (_short_remote, "averaged 40 prompt tokens"),
    "kv_uncompressed_busy_link": (_uncompressed_busy, "KV wire/raw 1.00"),
    "low_prefix_hit_rate": (_low_hit_rate, "prefill prefix-cache hit rate 0.5%"),
    "instance_down": (_instance_down, "here-prefill-0 fails the scheduler's health checks"),
}


def test_every_rule_of_the_table_has_a_symptom_test() -> None:
    assert {r.id for r in RULES} == set(SYMPTOMS)
    for r in RULES:
        assert r.m8.startswith("M8.") and r.symptom and r.cause and r.fix


@pytest.mark.parametrize("rule", sorted(SYMPTOMS))
def test_each_symptom_is_named_by_its_rule_with_the_numbers_seen(rule: str) -> None:
    make, number = SYMPTOMS[rule]
    s = Scene()
    make(s)
    found = s.findings()
    assert set(found) == {rule}, found
    assert any(number in line for line in found[rule]), found[rule]


def test_counters_that_did_not_grow_in_the_window_are_no_finding() -> None:
    """Checksum failures long ago (the same total in both snapshots) are history, not a symptom now."""
    s = Scene()
    _corruption(s)
    s.metrics_before = copy.deepcopy(s.metrics)
    s.cluster_before = copy.deepcopy(s.cluster)
    assert s.findings() == {}


def test_one_reading_judges_counters_by_their_totals() -> None:
    s = Scene()
    _corruption(s)
    w = Window(_snap(1005.0, s.metrics, s.cluster))
    (f,) = evaluate(w)
    assert f.rule.id == "kv_transfer_failures"
    assert "3 KV frame(s) failed their checksum since the processes started" in f.evidence


def test_a_restarted_process_counts_from_zero() -> None:
    s = Scene()
    s.metrics_before["here-decode-0"][("crossfill_kv_retries_total", ())] = 50
    s.metrics["here-decode-0"][("crossfill_kv_retries_total", ())] = 2  # restarted, then retried twice
    assert "decode retried 2 KV transfer attempt(s) in 5.0 s" in s.findings()["kv_transfer_failures"]


def test_an_unreadable_service_is_a_finding() -> None:
    after = _snap(1005.0, _healthy_metrics(), _healthy_cluster())
    after.services["far-prefill-0"] = Service("far-prefill-0", "prefill", "far", None, None,
                                              "/metrics unreadable (ConnectError: refused)")
    (f,) = evaluate(Window(after))
    assert f.rule.id == "instance_down" and "far-prefill-0: /metrics unreadable" in f.evidence[0]


def test_snapshots_survive_a_save_and_load_and_judge_the_same() -> None:
    s = Scene()
    _prefill_backlog(s)
    w = s.window()
    assert w.before is not None
    again = Window(Snapshot.from_json(w.after.to_json()), Snapshot.from_json(w.before.to_json()))
    assert [f.as_dict() for f in evaluate(again)] == [f.as_dict() for f in evaluate(w)]


def test_parse_metrics_reads_the_prometheus_text_format() -> None:
    text = ('# TYPE crossfill_errors counter\ncrossfill_errors_total{code="decode_full"} 4.0\n'
            'crossfill_errors_created{code="decode_full"} 1.7e9\n# TYPE crossfill_queue_depth gauge\n'
            'crossfill_queue_depth 3.0\n')
    assert parse_metrics(text) == (("crossfill_errors_total", {"code": "decode_full"}, 4.0),
                                   ("crossfill_queue_depth", {}, 3.0))


def test_the_report_prints_evidence_cause_and_fix() -> None:
    s = Scene()
    _decode_full(s)
    w = s.window()
    text = report(w, evaluate(w))
    assert "[decode_full] Decode full (M8.4)" in text
    assert "evidence: decode here-decode-0 holds 32/32 requests" in text
    assert "fix:      add decode instances" in text
    assert "no findings" in report(w, [])
