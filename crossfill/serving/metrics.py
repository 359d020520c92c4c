"""Prometheus metrics of the serving processes (M5.10), switched by observability.metrics_enabled.

Each process owns one registry; `/metrics` serves it when metrics are enabled and answers 404
otherwise, so turning the key off really removes the endpoint. The metrics defined here are the
first ones; the rest of M5.10 is grouped by who updates it in `crossfill.observability.metrics_defs`
(`gw`, `worker`, `sched`), and what a service already keeps is read at scrape time by the
collectors of `crossfill.observability.collectors` and `.process` (CPU/GPU use, RSS).
docs/OBSERVABILITY.md lists every name.
"""

from __future__ import annotations

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from crossfill.observability.metrics_defs import GatewayMetrics, SchedulerMetrics, WorkerMetrics
from crossfill.observability.process import register_process_metrics
from crossfill.serving.errors import APIError

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServingMetrics:
    def __init__(self, name: str | None = None, role: str | None = None, datacenter: str | None = None) -> None:
        """`name`/`role`/`datacenter`: who this process is, exported as `crossfill_instance_info`."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("crossfill_requests", "Requests finished, by route and outcome",
                                ["route", "outcome"], registry=r)
        self.fallbacks = Counter("crossfill_fallbacks", "Requests served differently than first planned, by reason",
                                 ["reason"], registry=r)
        self.errors = Counter("crossfill_errors", "Requests ended with an error, by code", ["code"], registry=r)
        self.retries = Counter("crossfill_kv_retries", "KV transfer attempts repeated", registry=r)
        self.ttft = Histogram("crossfill_ttft_seconds", "Time to first token", ["route"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("crossfill_e2e_seconds", "End-to-end request latency", ["route"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("crossfill_prefill_seconds", "Prefill compute time", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.transfer = Histogram("crossfill_kv_transfer_seconds", "KV transfer tail after prefill",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_raw = Counter("crossfill_kv_raw_bytes", "KV bytes before the codec", registry=r)
        self.kv_wire = Counter("crossfill_kv_wire_bytes", "KV bytes on the wire", registry=r)
        self.queue = Gauge("crossfill_queue_depth", "Requests queued or running in this instance", registry=r)
        self.tokens = Counter("crossfill_output_tokens", "Generated tokens", registry=r)
        self.kv_reused_tokens = Counter("crossfill_kv_reused_tokens", "Prompt tokens whose KV decode already held, "
                                        "so they did not cross the wire", registry=r)
        self.kv_saved = Counter("crossfill_kv_wire_bytes_saved", "Estimated wire bytes the decode-held prefix "
                                "did not need", registry=r)
        self.reuse_refused = Counter("crossfill_kv_reuse_refused", "Decode-held-prefix claims prefill did not use "
                                     "(everything was sent), by reason", ["reason"], registry=r)
        self.cleanup_failures = Counter("crossfill_cleanup_failures", "Aborts or frees that raised (logged)",
                                        ["what"], registry=r)
        self.ticket_refusals = Counter("crossfill_ticket_refusals", "Transfer tickets refused (prefill jobs, "
                                       "decode jobs, KV manifests), by reason", ["reason"], registry=r)
        self.preemptions = Gauge("crossfill_preemptions", "Requests preempted by the engine for KV memory "
                                 "(cumulative, from the engine)", registry=r)
        self.gw = GatewayMetrics(r)
        self.worker = WorkerMetrics(r)
        self.sched = SchedulerMetrics(r)
        register_process_metrics(r)
        if name is not None:
            Info("crossfill_instance", "Which process answers this scrape", registry=r).info(
                {"instance_name": name, "instance_role": role or "", "instance_datacenter": datacenter or ""})


def add_metrics_route(app: FastAPI, metrics: ServingMetrics, enabled: bool) -> None:
    @app.get("/metrics")
    async def prometheus() -> Response:
        if not enabled:
            raise APIError(404, "metrics are disabled (inference_service.observability.metrics_enabled: false)",
                           code="metrics_disabled")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
