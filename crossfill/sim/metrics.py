"""What one run measured, as a JSON-able dictionary (the table, --json and the plot all read it).

Goodput is the rate of requests that completed within both SLOs (TTFT within its budget, TPOT
within `slo.tpot_ms`), over the span of arrivals; attainment is their share of all requests
(refused and unfinished ones count as missed). Latency percentiles are over completed requests.
Link utilisation is bytes carried per second over the link's nominal bandwidth, sampled each
second from the first arrival to the last completion.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from crossfill.sim.cluster import RunResult
from crossfill.sim.sections import Slo


def good_mask(result: RunResult, slo: Slo) -> np.ndarray:
    ttft = np.asarray(result.ttft, dtype=float)
    tpot = np.asarray(result.tpot, dtype=float)
    prompt = np.asarray(result.requests.prompt, dtype=float)
    budget = slo.ttft_s + slo.ttft_s_per_1k_tokens * prompt / 1000.0
    with np.errstate(invalid="ignore"):
        return (ttft <= budget) & (tpot <= slo.tpot_s + 1e-12)


def summarize(result: RunResult, slo: Slo) -> dict[str, Any]:
    req = result.requests
    n = len(req)
    arrival = np.asarray(req.arrival, dtype=float)
    span = float(arrival[-1] - arrival[0]) if n > 1 else 1.0
    span = span if span > 0 else 1.0
    ttft = np.asarray(result.ttft, dtype=float)
    tpot = np.asarray(result.tpot, dtype=float)
    done = ~np.isnan(tpot)
    good = good_mask(result, slo)
    path = np.asarray(result.path)
    prompt = np.asarray(req.prompt, dtype=float)
    cached = np.asarray(result.cached, dtype=float)
    errors = Counter(e for e in result.error if e is not None)
    st = result.strategy
    util = link_utilisation(result)
    return {
        "strategy": st.name,
        "layout": {"remote_prefill": st.remote_instances, "local_prefill": st.local_prefill, "decode": st.decode},
        "threshold_tokens": st.threshold_tokens or st.config.routing.long_context_threshold_tokens,
        "notes": list(st.notes),
        "requests": n,
        "completed": int(done.sum()),
        "offered_rps": n / span,
        "throughput_rps": float(done.sum()) / span,
        "goodput_rps": float(good.sum()) / span,
        "slo_attainment": float(good.sum()) / max(n, 1),
        "analytic_rps": st.analytic.throughput_rps if st.analytic else None,
        "analytic_bottleneck": st.analytic.bottleneck if st.analytic else None,
        "ttft_s": _percentiles(ttft[done]),
        "tpot_ms": {k: v * 1000 if v is not None else None for k, v in _percentiles(tpot[done]).items()},
        "link_utilisation": {"mean": float(util.mean()) if util.size else 0.0,
                             "p99": float(np.percentile(util, 99)) if util.size else 0.0},
        "link_egress_gbps_mean": result.kv_bytes_sent * 8 / 1e9 / span,
        "kv_bytes_sent": result.kv_bytes_sent,
        "offload_share": float((path[done] == 2).mean()) if done.any() else 0.0,
        "prefix_hit_rate": float(cached[done].sum() / prompt[done].sum()) if done.any() else 0.0,
        "requests_with_prefix_hit": float((cached[done] > 0).mean()) if done.any() else 0.0,
        "busy": _busy(result, span),
        "deferred": result.deferred,
        "errors": dict(sorted(errors.items())),
        "error_total": int(sum(errors.values())),
        "route_retries": result.retried_routes,
        "transfer_retries": result.transfer_retries,
        "local_fallbacks": result.local_fallbacks,
        "decisions": result.decisions,
        "simulated_s": result.end_time,
    }


def _busy(result: RunResult, span: float) -> dict[str, float | None]:
    """Share of each pool's capacity in use over the arrival span: prefill instance-seconds, and
    decode batch slots (max_batch per instance) occupied."""
    st, b = result.strategy, result.busy_s
    slots = st.decode * result.decode_max_batch

    def share(used: float, capacity: float) -> float | None:
        return used / (capacity * span) if capacity > 0 else None

    return {"remote_prefill": share(b["remote_prefill"], st.remote_instances),
            "local_prefill": share(b["local_prefill"], st.local_prefill),
            "decode_slots": share(b["decode"], slots)}


def link_utilisation(result: RunResult) -> np.ndarray:
    """Per-second utilisation from the first arrival to the last completion (empty: no link)."""
    if not result.link_served or result.link_gbps <= 0:
        return np.zeros(0)
    served = np.asarray(result.link_served) * 8 / (result.link_gbps * 1e9)
    start = int(result.requests.arrival[0])
    return served[start:] if start < served.size else served


def _percentiles(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}
