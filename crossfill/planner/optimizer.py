"""Offload threshold and local pool split that maximise cluster throughput.

The analytical model of "Prefill-as-a-Service" (Moonshot AI / Tsinghua, 2026): prompts longer than
a threshold t are prefilled in a remote pool and their KV crosses the inter-DC link; the others are
prefilled by local prefill instances; every request then decodes locally. With p = P(L > t):

* remote path, requests/s:  min(N_remote / E[T_remote(L) | L > t],  link_bytes_per_s / E[KV(L) | L > t])
* local prefill, requests/s: N_prefill / E[T_local(L) | L <= t]
* decode, requests/s:        N_decode x B / (TPOT(B) x output_len), B the largest batch meeting the SLO
                             (and, when the decode profile gives its KV capacity, holding B requests'
                             mean KV at prompt + output length)

The cluster sustains Lambda = min(remote / p, local_prefill / (1 - p), decode) requests/s (a stage
serving only a share of requests is divided by that share). `optimize` searches t over the
workload's quantiles (every distinct length of an empirical trace) and every split
N_prefill + N_decode = N_local, and keeps the best Lambda; ties go to the smaller offloaded share
(less link traffic), then to more decode instances.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from crossfill.planner.errors import PlanError
from crossfill.planner.profiles import DecodeProfile, PrefillProfile
from crossfill.planner.workload import EmpiricalWorkload, LengthFn, Workload


@dataclass(frozen=True)
class ClusterSetup:
    workload: Workload
    remote_prefill: PrefillProfile
    local_prefill: PrefillProfile
    decode: DecodeProfile
    remote_instances: int
    local_instances: int  # split between local prefill and decode
    link_gbps: float
    kv_bytes: LengthFn  # bytes one prompt of length L sends from prefill to decode

    def __post_init__(self) -> None:
        if self.remote_instances < 0:
            raise PlanError(f"pools.remote.instances: {self.remote_instances} must be >= 0")
        if self.local_instances < 1:
            raise PlanError(f"pools.local.instances: {self.local_instances} must be >= 1 (decode runs locally)")
        if not self.link_gbps >= 0:
            raise PlanError(f"link.gbps: {self.link_gbps} must be >= 0")

    @cached_property
    def decode_kv_bytes(self) -> float:
        """Mean KV a decoding request holds at its end (prompt + output tokens)."""
        out = self.decode.output_len
        return self.workload.expect(lambda lengths: self.kv_bytes(np.asarray(lengths) + out))

    def decode_batch(self) -> int:
        return self.decode.max_batch(self.decode_kv_bytes)

    def decode_rps_per_instance(self) -> float:
        return self.decode.requests_per_second(self.decode_kv_bytes)


@dataclass(frozen=True)
class Evaluation:
    threshold: float  # prompts longer than this go remote
    offload_share: float
    offload_mean_len: float
    local_mean_len: float
    remote_instances: int
    local_prefill_instances: int
    decode_instances: int
    remote_compute_rps: float  # capacity of each stage, requests/s of the requests it serves
    remote_link_rps: float
    local_prefill_rps: float
    decode_rps: float
    throughput_rps: float  # Lambda, the whole cluster
    bottleneck: str
    link_egress_gbps: float  # at Lambda
    link_utilisation: float

    def as_dict(self) -> dict[str, object]:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class _PathStats:
    """Everything about a threshold that does not depend on the pool split."""

    t: float
    p: float
    mean_remote_len: float
    mean_local_len: float
    remote_compute: float
    remote_link: float
    local_seconds: float  # E[T_local | L <= t]
    kv_mean: float  # E[KV | L > t]


def _path_stats(setup: ClusterSetup, t: float) -> _PathStats:
    w = setup.workload
    p = w.share_above(t)
    # Snap numerically negligible shares so "offload nothing" never asks the remote pool for work.
    p = 0.0 if p < 1e-9 else (1.0 if p > 1 - 1e-9 else p)
    q = 1.0 - p
    link_bps = setup.link_gbps * 1e9 / 8
    if p > 0:
        t_remote = w.expect(setup.remote_prefill.seconds_at, above=t) / p
        kv_mean = w.expect(setup.kv_bytes, above=t) / p
        compute = setup.remote_instances / t_remote if t_remote > 0 else math.inf
        link = link_bps / kv_mean if kv_mean > 0 else math.inf
    else:
        compute = link = math.inf
        kv_mean = 0.0
    local_seconds = w.expect(setup.local_prefill.seconds_at, at_most=t) / q if q > 0 else 0.0
    return _PathStats(t, p, w.mean_above(t), w.mean_at_most(t), compute, link, local_seconds, kv_mean)


def _evaluate(setup: ClusterSetup, s: _PathStats, n_prefill: int) -> Evaluation:
    n_decode = setup.local_instances - n_prefill
    decode = n_decode * setup.decode_rps_per_instance()
    local = n_prefill / s.local_seconds if s.local_seconds > 0 else (math.inf if n_prefill > 0 else 0.0)
    q = 1.0 - s.p
    limits = {"decode": decode}
    if s.p > 0:
        limits["remote prefill compute"] = s.remote_compute / s.p
        limits["inter-DC link"] = s.remote_link / s.p
    if q > 1e-15:
        limits["local prefill"] = local / q
    bottleneck = min(limits, key=lambda k: limits[k])
    lam = limits[bottleneck]
    egress = lam * s.p * s.kv_mean * 8 / 1e9
    return Evaluation(
        threshold=s.t,
        offload_share=s.p,
        offload_mean_len=s.mean_remote_len,
        local_mean_len=s.mean_local_len,
        remote_instances=setup.remote_instances,
        local_prefill_instances=n_prefill,
        decode_instances=n_decode,
        remote_compute_rps=s.remote_compute,
        remote_link_rps=s.remote_link,
        local_prefill_rps=local,
        decode_rps=decode,
        throughput_rps=lam,
        bottleneck=bottleneck,
        link_egress_gbps=egress,
        link_utilisation=egress / setup.link_gbps if setup.link_gbps > 0 else 0.0,
    )


def evaluate(setup: ClusterSetup, threshold: float, local_prefill_instances: int) -> Evaluation:
    """Throughput of one configuration (threshold t, N_prefill local prefill instances)."""
    if not 0 <= local_prefill_instances < setup.local_instances:
        raise PlanError(
            f"local prefill instances: {local_prefill_instances} must be in [0, {setup.local_instances - 1}] "
            "so at least one local instance decodes"
        )
    return _evaluate(setup, _path_stats(setup, threshold), local_prefill_instances)


def candidate_thresholds(workload: Workload, points: int = 200) -> list[float]:
    """Thresholds worth trying: "offload everything", "offload nothing" and the lengths in between."""
    lo, hi = workload.lo, workload.hi
    if isinstance(workload, EmpiricalWorkload):
        inner = np.unique(workload.lengths)
        if inner.size > points:
            inner = np.unique(np.quantile(workload.lengths, np.linspace(0, 1, points + 1), method="lower"))
        values = [lo * 0.5, *inner.tolist()]
    else:
        top = hi if hi < math.inf else workload.quantile(1 - 1e-9)
        values = [lo, *(workload.quantile(q) for q in np.linspace(0, 1, points + 1)[1:-1]), top]
    return sorted({float(v) for v in values})


def optimize(setup: ClusterSetup, thresholds: list[float] | None = None) -> tuple[Evaluation, list[Evaluation]]:
    """Best configuration, and the best split at every threshold tried (for plots and tables)."""
    per_threshold: list[Evaluation] = []
    for t in thresholds or candidate_thresholds(setup.workload):
        stats = _path_stats(setup, t)
        if stats.p > 0 and setup.remote_instances == 0:
            continue  # nothing can run remotely
        best_here = max(
            (_evaluate(setup, stats, n) for n in range(setup.local_instances)),
            key=lambda e: (e.throughput_rps, e.decode_instances),
        )
        per_threshold.append(best_here)
    if not per_threshold:
        raise PlanError("optimizer: no feasible configuration; give the remote pool instances or widen the workload")
    top = max(e.throughput_rps for e in per_threshold)
    tied = [e for e in per_threshold if e.throughput_rps >= top * (1 - 1e-9)]
    best = min(tied, key=lambda e: (e.offload_share, -e.decode_instances))
    return best, per_threshold


def local_only(setup: ClusterSetup) -> Evaluation:
    """The best the local cluster does alone (nothing offloaded): the baseline the optimum beats."""
    t = setup.workload.hi if setup.workload.hi < math.inf else setup.workload.quantile(1 - 1e-9)
    stats = _path_stats(setup, t)
    return max((_evaluate(setup, stats, n) for n in range(setup.local_instances)), key=lambda e: e.throughput_rps)
