"""M5.10 on a running cluster: every metric on the /metrics of the service it belongs to, and the request log.

The cluster runs as a deployment does (`crossfill up`, every service logging into one file), with a
tenant named in `observability.metric_tenants`. Traffic: a short local request, the same long
prompt twice on remote prefill (the second finds it in both prefix caches), a request of an
unnamed tenant, a prompt past the context (an error), KV bytes corrupted on the emulated WAN, and a
stream whose decode worker is killed after its first token. Every service's /metrics is parsed
with prometheus_client's own parser; the request log lines are parsed from the log file.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving.serving_cluster import Cluster, cluster_config, free_port_block, quiet_timeouts
from serving.serving_helpers import LONG, arm, disarm, generate, unique_long, wait_until

from crossfill.config import load_config
from crossfill.reliability.procs import UpProcess

pytestmark = pytest.mark.timeout(600)

MARK = f"Pangolin-{uuid.uuid4().hex[:10]}"  # in every prompt; must appear in no log line
MAX_TOKENS = 12
DECODE, LOCAL_PREFILL, REMOTE_PREFILL = "here-decode-0", "here-prefill-0", "far-prefill-0"
TEN_FIELDS = ("request_id", "tenant_id", "routing_path", "prefill_instance", "decode_instance", "cache_id",
              "durations_ms", "error_code", "retry_count", "degradation_reason")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def get(m: Samples, name: str, **labels: str) -> float:
    """The sample `name{labels}` (exactly those labels); 0 when it does not exist yet."""
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def has(m: Samples, name: str) -> bool:
    return any(n == name for n, _ in m)


def request_lines(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            if "stage" in obj and "service" in obj:
                out.append(obj)
    return out


@pytest.fixture(scope="module")
def run(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, UpProcess]]:
    d = tmp_path_factory.mktemp("metrics-live")
    doc = quiet_timeouts(cluster_config(tiny_llama_dir, free_port_block(120)))
    doc["model"]["served_name"] = "tiny"
    doc["inference_service"]["observability"]["metric_tenants"] = ["acme"]
    path = d / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    up = UpProcess(path, d / "logs" / "up.log")
    try:
        asyncio.run(up.start(300))
        c = Cluster(load_config(path), path, [])
        c.wait_scheduler(lambda v: all(i["healthy"] and i["ready"] for i in v["instances"].values()))
        yield c, up
    finally:
        up.stop(60)


@pytest.fixture(scope="module")
def traffic(run: tuple[Cluster, UpProcess]) -> dict[str, Any]:
    c, _ = run
    long_prompt = f"{MARK} {LONG}"
    out: dict[str, Any] = {
        "local": generate(c.url, f"{MARK} short", "local_only", MAX_TOKENS, tenant_id="acme", ignore_eos=True),
        "remote": [generate(c.url, long_prompt, "remote_required", MAX_TOKENS, tenant_id="acme", ignore_eos=True)
                   for _ in range(2)],
        "other_tenant": generate(c.url, f"{MARK} short", "local_only", MAX_TOKENS, tenant_id=f"t-{uuid.uuid4().hex}"),
        "too_long": generate(c.url, MARK, "auto", max_tokens=100_000),
    }
    for r in (out["local"], *out["remote"], out["other_tenant"]):
        assert r.status_code == 200, r.text
    assert out["too_long"].status_code == 400
    # What decode reports after a transfer (to the scheduler, and its own duration) arrives after the answer.
    sched, decode = c.cfg.scheduler_url(), c.worker_url(DECODE)
    wait_until("the scheduler got both remote transfer reports",
               lambda: get(scrape(sched), "crossfill_link_transfers_total", link="far", outcome="ok") >= 2)
    wait_until("decode timed both remote transfers",
               lambda: get(scrape(decode), "crossfill_kv_transfer_duration_seconds_count", route="remote") >= 2)
    return out


def test_every_m510_metric_is_on_the_service_it_belongs_to(run: tuple[Cluster, UpProcess],
                                                          traffic: dict[str, Any]) -> None:
    c, _ = run
    gw, sched = scrape(c.url), scrape(c.cfg.scheduler_url())
    dec, pre_far, pre_here = (scrape(c.worker_url(n)) for n in (DECODE, REMOTE_PREFILL, LOCAL_PREFILL))

    # Request count, success/error rate: errors are requests too, by bounded tenant.
    assert get(gw, "crossfill_requests_total", route="local", outcome="ok") >= 2
    assert get(gw, "crossfill_requests_total", route="remote", outcome="ok") >= 2
    assert get(gw, "crossfill_requests_total", route="none", outcome="error") >= 1  # the prompt past the context
    assert get(gw, "crossfill_errors_total", code="context_length_exceeded") >= 1
    assert get(gw, "crossfill_requests_by_tenant_total", tenant="acme", route="remote", outcome="ok") == 2
    assert get(gw, "crossfill_requests_by_tenant_total", tenant="other", route="local", outcome="ok") >= 1
    assert not any(dict(labels).get("tenant", "").startswith("t-") for _, labels in gw)  # never the raw id
    # TTFT, end-to-end latency, per-stage durations: histograms by route.
    for name in ("crossfill_ttft_seconds_count", "crossfill_e2e_seconds_count"):
        assert get(gw, name, route="remote") >= 2 and get(gw, name, route="local") >= 2, name
    for stage in ("queue", "prefill", "transfer", "decode"):
        assert get(gw, "crossfill_request_stage_seconds_count", stage=stage, route="remote") >= 2, stage
    assert get(gw, "crossfill_request_output_tokens_total", route="remote", tenant="acme") == 2 * MAX_TOKENS
    assert has(gw, "crossfill_queue_depth")  # instance queue length, on the gateway too

    # Prefill time, its queue, and the prefill-side prefix cache (the repeated prompt hit it).
    assert get(pre_far, "crossfill_prefill_seconds_count") >= 2
    assert get(pre_far, "crossfill_prefill_queue_seconds_count") >= 2
    hit, query = (get(pre_far, f"crossfill_prefix_cache_{k}_tokens_total", side="prefill") for k in ("hit", "query"))
    assert 0 < hit < query  # cache hit rate = hit / query
    assert get(pre_far, "crossfill_kv_frames_sent_total", route="remote") > 0  # retransmit-rate denominator
    assert has(pre_far, "crossfill_kv_frames_retransmitted_total")
    assert get(pre_here, "crossfill_kv_frames_sent_total", route="local") > 0
    assert get(pre_far, "crossfill_engine_kv_blocks", state="total") > 0
    assert has(pre_far, "crossfill_engine_preemptions_total")

    # Decode throughput, KV size (raw and wire), transfer latency, decode-side prefix cache.
    assert get(dec, "crossfill_output_tokens_total") >= 4 * MAX_TOKENS
    assert get(dec, "crossfill_decode_tokens_per_second_count", route="remote") >= 2
    assert get(dec, "crossfill_decode_tokens_per_second_sum", route="remote") > 0
    remote_kv = traffic["remote"][0].json()["crossfill"]
    assert get(dec, "crossfill_kv_transfer_raw_bytes_sum", route="remote") >= remote_kv["kv_raw_bytes"] > 0
    assert get(dec, "crossfill_kv_transfer_wire_bytes_sum", route="remote") >= remote_kv["kv_wire_bytes"] > 0
    assert get(dec, "crossfill_kv_transfer_duration_seconds_count", route="remote") >= 2
    assert get(dec, "crossfill_kv_transfers_total", route="remote", outcome="ok") >= 2
    assert get(dec, "crossfill_prefix_cache_hit_tokens_total", side="decode") > 0  # the repeated prompt was held
    assert get(dec, "crossfill_prefix_cache_query_tokens_total", side="decode") > 0
    assert get(dec, "crossfill_kv_frames_received_total", result="accepted") > 0
    assert has(dec, "crossfill_kv_checksum_failures_total") and has(dec, "crossfill_kv_integrity_failures_total")
    assert get(dec, "crossfill_requests_total", route="remote", outcome="ok") >= 2

    # Routing decisions by rule, links (latency, capacity, utilisation, loss, retransmits), instances.
    assert get(sched, "crossfill_routing_decisions_total", route="remote", reason="policy_remote_required",
               degraded="false") >= 2
    assert get(sched, "crossfill_routing_decisions_total", route="local", reason="policy_local_only",
               degraded="false") >= 2
    assert get(sched, "crossfill_link_rtt_seconds", link="far") > 0
    assert get(sched, "crossfill_link_capacity_bytes_per_second", link="far") == 1e9 / 8  # 1 Gbit/s configured
    assert get(sched, "crossfill_link_sent_bytes_total", link="far") >= remote_kv["kv_wire_bytes"]
    assert 0 <= get(sched, "crossfill_link_utilization_ratio", link="far") <= 1
    for name in ("crossfill_link_loss_ratio", "crossfill_link_retransmit_ratio", "crossfill_link_up",
                 "crossfill_link_in_flight_bytes", "crossfill_link_egress_bytes_per_second"):
        assert (name, (("link", "far"),)) in sched, name
    assert get(sched, "crossfill_link_breaker_state", link="far", state="closed") == 1
    assert get(sched, "crossfill_scheduler_instance_up", worker=DECODE, worker_role="decode",
               worker_datacenter="here") == 1
    assert has(sched, "crossfill_scheduler_instance_queue_depth") and has(sched, "crossfill_batch_queue_depth")

    # Every service: who it is, and its "accelerator" (CPU) utilisation and memory.
    for name, m in (("gateway", gw), ("scheduler", sched), (DECODE, dec), (REMOTE_PREFILL, pre_far)):
        info = [dict(labels) for n, labels in m if n == "crossfill_instance_info"]
        assert info and info[0]["instance_name"] == name
        assert get(m, "crossfill_accelerator_utilization_ratio", device="cpu") >= 0
        assert get(m, "crossfill_accelerator_memory_used_bytes", device="cpu") > 0
        assert get(m, "process_cpu_seconds_total") > 0 and get(m, "process_resident_memory_bytes") > 0


def test_corrupted_kv_bytes_count_as_integrity_failures_and_retransmits(run: tuple[Cluster, UpProcess],
                                                                       traffic: dict[str, Any]) -> None:
    c, _ = run
    decode, far, sched = c.worker_url(DECODE), c.worker_url(REMOTE_PREFILL), c.cfg.scheduler_url()
    before_dec, before_far, before_sched = scrape(decode), scrape(far), scrape(sched)
    control = c.emulator_control(DECODE, "kv")
    arm(control, corrupt_bytes=64)
    try:
        r = generate(c.url, f"{MARK} {unique_long()}", "remote_required", MAX_TOKENS, tenant_id="corrupt")
    finally:
        disarm(control)
    assert r.status_code == 200, r.text  # the receiver refused the damaged bytes, the sender sent them again
    wait_until("the scheduler got the transfer report",
               lambda: get(scrape(sched), "crossfill_link_transfers_total", link="far", outcome="ok")
               > get(before_sched, "crossfill_link_transfers_total", link="far", outcome="ok"))
    after_dec, after_far, after_sched = scrape(decode), scrape(far), scrape(sched)

    def grew(before: Samples, after: Samples, name: str, **labels: str) -> float:
        return get(after, name, **labels) - get(before, name, **labels)

    assert grew(before_dec, after_dec, "crossfill_kv_integrity_failures_total") >= 1
    assert grew(before_dec, after_dec, "crossfill_kv_frames_received_total", result="refused") >= 1
    assert grew(before_far, after_far, "crossfill_kv_frames_retransmitted_total", route="remote") >= 1
    assert grew(before_far, after_far, "crossfill_kv_reconnects_total", route="remote") >= 1  # the damaged stream
    assert grew(before_sched, after_sched, "crossfill_link_frames_retransmitted_total", link="far") >= 1


def test_each_stage_writes_one_json_line_with_the_ten_fields(run: tuple[Cluster, UpProcess],
                                                            traffic: dict[str, Any]) -> None:
    _, up = run
    lines = request_lines(up.log_path)
    assert MARK not in up.log_path.read_text(errors="replace")  # no prompt, anywhere in the log
    for r in traffic["remote"]:
        body = r.json()
        rid, route = body["request_id"], body["crossfill"]
        mine = {(x["service"], x["stage"]): x for x in lines if x["request_id"] == rid}
        assert set(mine) == {("gateway", "request"), ("decode", "decode"), ("prefill", "prefill")}, mine
        assert len([x for x in lines if x["request_id"] == rid]) == 3  # one line per stage
        for x in mine.values():
            assert set(TEN_FIELDS) <= set(x), x
            assert (x["status"], x["error_code"], x["tenant_id"]) == ("ok", None, "acme")
            assert (x["prefill_instance"], x["decode_instance"]) == (REMOTE_PREFILL, DECODE)
            assert x["cache_id"] == route["cache_id"] and x["trace_id"] == route["trace_id"]
            assert x["routing_path"] == f"remote: {REMOTE_PREFILL} -> {DECODE}"
            assert x["retry_count"] == 0 and x["degradation_reason"] is None
        assert mine[("prefill", "prefill")]["instance"] == REMOTE_PREFILL
        assert mine[("gateway", "request")]["level"] == "info"
        assert {"queue", "prefill", "transfer", "decode", "total"} <= set(mine[("gateway", "request")]["durations_ms"])
        assert {"queue", "prefill"} <= set(mine[("prefill", "prefill")]["durations_ms"])
    refused = [x for x in lines if x["service"] == "gateway" and x["error_code"] == "context_length_exceeded"]
    assert refused and refused[0]["status"] == "error" and refused[0]["level"] == "warning"
    assert refused[0]["routing_path"] == "none"


def test_an_error_after_the_first_token_is_counted_and_logged(run: tuple[Cluster, UpProcess],
                                                             traffic: dict[str, Any]) -> None:
    """Last in this module: it kills the decode worker (`up` starts it again)."""
    c, up = run
    before = get(scrape(c.url), "crossfill_requests_total", route="local", outcome="error_after_first_token")
    rid = f"mid-stream-{uuid.uuid4().hex[:8]}"
    body = {"prompt": f"{MARK} short", "max_tokens": 1500, "temperature": 0, "prefill_policy": "local_only",
            "ignore_eos": True, "stream": True, "request_id": rid}
    chunks = []
    with httpx.stream("POST", c.url + "/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
        for chunk in lines:
            if chunk.get("token_ids"):
                break  # the client has its first token
        up.children()[DECODE].kill()
        chunks = list(lines)
    assert chunks and chunks[-1]["error"]["code"] == "decode_failed", chunks[-1:]
    after = get(scrape(c.url), "crossfill_requests_total", route="local", outcome="error_after_first_token")
    assert after == before + 1
    line = next(x for x in request_lines(up.log_path) if x["request_id"] == rid and x["service"] == "gateway")
    assert (line["status"], line["error_code"], line["decode_instance"]) == \
        ("error_after_first_token", "decode_failed", DECODE)
