"""The M5.10 metrics added beside `crossfill.serving.metrics.ServingMetrics`, grouped by who updates them.

Every process registers all of them (one registry per process, as before), so a dashboard query
finds each name on every target; only the process the table in docs/OBSERVABILITY.md names ever
moves one. Label names never reuse the scrape config's target labels (`service`, `role`,
`datacenter`, Prometheus' `instance`): Prometheus would rename a clash to `exported_*`. A metric
about another component says so in its label (`link`, `worker`, ...).

Label values are bounded: routes, outcomes, stages and reasons are fixed sets; `tenant` is a
tenant named in the config, "none" or "other" (`TenantLabels`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from crossfill.config import CrossfillConfig

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BYTES_BUCKETS = tuple(1024 * 4**k for k in range(12))  # 1 KiB .. 4 GiB
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

# Per-stage durations the request's route info carries (timings_ms keys); others are not exported.
STAGES = ("queue", "prefill", "transfer", "first_decode", "decode")


class TenantLabels:
    """`tenant` label values: a tenant the config names, "none" without one, "other" for the rest.

    A request body may name any tenant when API keys are off, so the raw id would let a client
    create series without bound; the config's tenants are the ones an operator tracks.
    """

    def __init__(self, cfg: CrossfillConfig) -> None:
        sec = cfg.security
        self.known = frozenset([*cfg.inference_service.routing.tenants, *sec.limits.tenants,
                                *(k.tenant for k in sec.auth.dev_keys),
                                *cfg.inference_service.observability.metric_tenants])

    def __call__(self, tenant_id: str | None) -> str:
        if not tenant_id:
            return "none"
        return tenant_id if tenant_id in self.known else "other"


class GatewayMetrics:
    """Per request, as the client saw it (the gateway)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.by_tenant = Counter("crossfill_requests_by_tenant", "Requests finished, by bounded tenant, route and "
                                 "outcome", ["tenant", "route", "outcome"], registry=r)
        self.stage = Histogram("crossfill_request_stage_seconds", "Per-stage durations of finished requests",
                               ["stage", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("crossfill_request_prompt_tokens", "Prompt tokens of finished requests",
                                     ["route", "tenant"], registry=r)
        self.output_tokens = Counter("crossfill_request_output_tokens", "Completion tokens of finished requests",
                                     ["route", "tenant"], registry=r)


class WorkerMetrics:
    """Prefill and decode: compute, KV transfers, prefix caches."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.prefill_queue = Histogram("crossfill_prefill_queue_seconds", "Time a prefill waited before computing",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.decode_tps = Histogram("crossfill_decode_tokens_per_second", "Per-request decode speed",
                                    ["route"], buckets=TOKENS_PER_S_BUCKETS, registry=r)
        self.decode_seconds = Histogram("crossfill_decode_seconds", "Per-request decode time, first to last token",
                                        ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_raw = Histogram("crossfill_kv_transfer_raw_bytes", "Raw KV bytes per transfer (before the codec)",
                                ["route"], buckets=BYTES_BUCKETS, registry=r)
        self.kv_wire = Histogram("crossfill_kv_transfer_wire_bytes", "Wire KV bytes per transfer (after the codec)",
                                 ["route"], buckets=BYTES_BUCKETS, registry=r)
        self.kv_duration = Histogram("crossfill_kv_transfer_duration_seconds", "Whole KV transfer, open to commit "
                                     "acknowledged (sender's clock)", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_transfers = Counter("crossfill_kv_transfers", "KV transfer attempts, by route and outcome",
                                    ["route", "outcome"], registry=r)
        self.frames_sent = Counter("crossfill_kv_frames_sent", "KV frames sent by completed transfers",
                                   ["route"], registry=r)
        self.frames_retransmitted = Counter("crossfill_kv_frames_retransmitted", "KV frames sent again (refused "
                                            "or on a broken stream)", ["route"], registry=r)
        # A stream broken mid-transfer (a reset, a TLS record that fails its MAC after corruption on
        # the link, a stall) reconnects; with TLS a damaged handshake shows only here.
        self.kv_reconnects = Counter("crossfill_kv_reconnects", "KV streams reopened during completed transfers",
                                     ["route"], registry=r)
        self.cache_hit = Counter("crossfill_prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache",
                                 ["side"], registry=r)
        self.cache_query = Counter("crossfill_prefix_cache_query_tokens", "Prompt tokens looked up in a prefix "
                                   "cache", ["side"], registry=r)


class SchedulerMetrics:
    """Routing decisions and what decode reports about each link."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.decisions = Counter("crossfill_routing_decisions", "Routes chosen (route local/remote) or refused "
                                 "(route refused, reason = error code), by rule", ["route", "reason", "degraded"],
                                 registry=r)
        self.link_sent = Counter("crossfill_link_sent_bytes", "KV wire bytes decode reported over the link",
                                 ["link"], registry=r)
        self.link_transfers = Counter("crossfill_link_transfers", "KV transfers reported over the link",
                                      ["link", "outcome"], registry=r)
        self.link_frames = Counter("crossfill_link_frames", "KV frames reported over the link", ["link"], registry=r)
        self.link_retransmitted = Counter("crossfill_link_frames_retransmitted", "KV frames retransmitted over "
                                          "the link", ["link"], registry=r)
