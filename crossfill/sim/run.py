"""`crossfill simulate` without the command line: a spec in, one report dictionary out.

Every strategy runs on the same requests (one draw per seed, or the trace). `--search-rate`
instead looks, per strategy, for the highest arrival rate at which `slo.attainment` of the
requests still meet both SLOs: the paper's "throughput at the SLO", found by bracketing the rate
and bisecting it, each probe a full simulation with the same seed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from crossfill.sim.cluster import ClusterSim, RunResult
from crossfill.sim.metrics import summarize
from crossfill.sim.simfile import SimSpec, with_rate
from crossfill.sim.strategies import Strategy, build_strategies
from crossfill.sim.workload import Requests, generate

_SEARCH_STEPS = 7  # bisection steps after bracketing: the rate is known to within ~(1.5)^(1/128)
_BRACKET_STEPS = 8


@dataclass
class Outcome:
    report: dict[str, Any]
    results: list[RunResult] = field(default_factory=list)  # for the plot


def requests_for(spec: SimSpec, trace: Requests | None, rate: float | None = None) -> Requests:
    if trace is not None:
        reqs = _head(trace, spec.requests)
        if rate is not None:
            base = len(reqs) / max(reqs.arrival[-1] - reqs.arrival[0], 1e-9)
            reqs = reqs.scaled(rate / base)
        return reqs
    workload = spec.workload if rate is None else with_rate(spec, rate).workload
    return generate(workload, spec.requests, spec.seed)


def _head(reqs: Requests, n: int) -> Requests:
    if len(reqs) <= n:
        return reqs
    return Requests(**{k: v[:n] if isinstance(v, list) else v for k, v in reqs.__dict__.items()})


def simulate(spec: SimSpec, trace: Requests | None = None) -> Outcome:
    strategies, skipped = build_strategies(spec)
    requests = requests_for(spec, trace)
    out = Outcome(report={})
    summaries = []
    for st in strategies:
        t0 = time.perf_counter()
        result = ClusterSim(spec, st, requests).run()
        wall = time.perf_counter() - t0
        s = summarize(result, spec.slo)
        s["wall_s"] = wall
        summaries.append(s)
        out.results.append(result)
    out.report = {"setup": describe(spec, requests), "strategies": summaries, "skipped": skipped,
                  "ratios": _ratios({s["strategy"]: s["goodput_rps"] for s in summaries}, "goodput_rps")}
    return out


def search_rates(spec: SimSpec, trace: Requests | None = None) -> Outcome:
    strategies, skipped = build_strategies(spec)
    rows = []
    for st in strategies:
        t0 = time.perf_counter()
        row = _search(spec, st, trace)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
    report = {"setup": describe(spec, requests_for(spec, trace)), "search": rows, "skipped": skipped,
              "ratios": _ratios({r["strategy"]: r["max_rate_rps"] for r in rows}, "max_rate_rps")}
    return Outcome(report=report)


def _search(spec: SimSpec, st: Strategy, trace: Requests | None) -> dict[str, Any]:
    target = spec.slo.attainment
    probes: list[dict[str, float]] = []

    def attainment(rate: float) -> float:
        reqs = requests_for(spec, trace, rate)
        s = summarize(ClusterSim(spec, st, reqs).run(), spec.slo)
        probes.append({"rate_rps": rate, "slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
                       "offload_share": s["offload_share"], "busy": s["busy"], "ttft_s": s["ttft_s"]})
        return s["slo_attainment"]

    start = st.analytic.throughput_rps if st.analytic and st.analytic.throughput_rps > 0 else spec.workload.arrival.rate
    lo, hi = 0.0, math.inf
    rate = start
    for _ in range(_BRACKET_STEPS):
        if attainment(rate) >= target:
            lo = rate
            if hi < math.inf:
                break
            rate *= 1.5
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 1.5
    if lo > 0 and hi < math.inf:
        for _ in range(_SEARCH_STEPS):
            mid = math.sqrt(lo * hi)
            if attainment(mid) >= target:
                lo = mid
            else:
                hi = mid
    return {"strategy": st.name, "layout": {"remote_prefill": st.remote_instances, "local_prefill": st.local_prefill,
                                            "decode": st.decode},
            "max_rate_rps": lo, "bracket_high_rps": None if math.isinf(hi) else hi, "target_attainment": target,
            "analytic_rps": st.analytic.throughput_rps if st.analytic else None, "probes": probes,
            "notes": list(st.notes)}


def _ratios(values: dict[str, float], what: str) -> dict[str, float | None]:
    full = values.get("full-policy")
    out: dict[str, float | None] = {}
    for base in ("homogeneous-pd", "naive-remote", "threshold-only"):
        if full is not None and base in values:
            out[f"full-policy / {base} ({what})"] = full / values[base] if values[base] > 0 else None
    return out


def describe(spec: SimSpec, requests: Requests) -> dict[str, Any]:
    setup = spec.setup
    mean = spec.setup.workload.mean()
    return {
        "source": spec.source,
        "model": spec.kv.name,
        "kv_wire_bytes_at_mean_prompt": spec.kv.wire_bytes(mean),
        "workload": setup.workload.describe(),
        "requests": len(requests),
        "requests_source": requests.source,
        "offered_rps": len(requests) / max(requests.arrival[-1] - requests.arrival[0], 1e-9) if len(requests) > 1 else None,
        "seed": spec.seed,
        "pools": {"remote": setup.remote_instances, "local": setup.local_instances,
                  "remote_hardware": spec.remote_hardware, "local_hardware": spec.local_hardware},
        "decode_max_batch": spec.decode.max_batch,
        "decode_capacity": spec.decode_capacity,
        "link": {"gbps": spec.link.gbps, "rtt_ms": spec.link.rtt_ms, "fluctuation": spec.link.fluctuation.kind,
                 "outages": len(spec.link.outages)},
        "slo": {"ttft_s": spec.slo.ttft_s, "ttft_s_per_1k_tokens": spec.slo.ttft_s_per_1k_tokens,
                "tpot_ms": spec.slo.tpot_s * 1000, "attainment": spec.slo.attainment},
        "candidates_per_pool": spec.candidates_k,
    }
