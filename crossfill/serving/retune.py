"""The slow timescale of routing: re-derive the long-prompt threshold from what the cluster sees.

Per request the policy routes (fast timescale). Every `routing.retune_interval_s` the scheduler
feeds the planner's PrfaaS throughput model (`crossfill.planner.optimizer`) with what it observed:
the prompt lengths of recent requests (an empirical workload), each pool's measured prefill
tokens/s, the link's bandwidth estimate and the KV wire bytes per token. Two answers come back:

- the live threshold: the one that maximises cluster throughput with the instances running now
  (local prefill count fixed); `auto` uses it unless `routing.pin_threshold` is true;
- recommended instance counts per prefill pool: at the observed arrival rate and the live
  threshold, how many local and remote prefill instances keep each pool below
  `_TARGET_UTILISATION`, and how busy the link is, for an operator or an autoscaler to act on.

Both are shown at `GET /v1/admin/plan` with their inputs. Decode capacity is not measured by the
scheduler, so the model gets a decode pool that is never the bottleneck: the threshold is a balance
between local prefill, remote prefill and the link, which decode does not move (with an assumed
decode profile the model would tie every threshold at the decode limit and offload nothing). Until
`min_samples` requests have been seen, the configured threshold stays.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from crossfill.config import CrossfillConfig
from crossfill.planner.errors import PlanError
from crossfill.planner.optimizer import ClusterSetup, candidate_thresholds, evaluate
from crossfill.planner.profiles import DecodeProfile, PrefillProfile
from crossfill.planner.workload import EmpiricalWorkload
from crossfill.policy import Snapshot

_UNBOUNDED_DECODE_TPOT_S = 1e-6  # decode is not what the threshold trades off (see above)
_TARGET_UTILISATION = 0.7


class Retuner:
    def __init__(self, cfg: CrossfillConfig, *, window: int = 5000, min_samples: int = 100) -> None:
        self.cfg = cfg
        self.routing = cfg.inference_service.routing
        self.lengths: deque[int] = deque(maxlen=window)
        self.arrivals: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self.threshold: int | None = None  # the live value; None: the configured one
        self.last: dict[str, Any] = {"status": "no plan yet", "samples": 0}

    def observe(self, prompt_tokens: int, now: float) -> None:
        if prompt_tokens > 0:
            self.lengths.append(prompt_tokens)
            self.arrivals.append(now)

    def arrival_rate(self) -> float | None:
        """Requests per second over the window (None: too few to say)."""
        if len(self.arrivals) < 2 or self.arrivals[-1] <= self.arrivals[0]:
            return None
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])

    def live_threshold(self) -> int | None:
        return None if self.routing.pin_threshold else self.threshold

    def retune(self, snap: Snapshot, link_gbps: float | None) -> dict[str, Any]:
        """Recompute the plan from `snap` (instances, measured speeds, KV size) and remember it."""
        self.last = self._plan(snap, link_gbps)
        if self.last.get("status") == "ok":
            self.threshold = int(self.last["live"]["threshold_tokens"])
        return self.last

    def _plan(self, snap: Snapshot, link_gbps: float | None) -> dict[str, Any]:
        configured = self.routing.long_context_threshold_tokens
        base: dict[str, Any] = {"samples": len(self.lengths), "configured_threshold_tokens": configured,
                                "pinned": self.routing.pin_threshold}
        if len(self.lengths) < self.min_samples:
            return {**base, "status": f"waiting for {self.min_samples} requests (seen {len(self.lengths)})"}
        local = snap.local_datacenter
        prefills = [s for s in snap.instances if s.role == "prefill"]
        local_p = [s for s in prefills if s.datacenter == local and s.available]
        remote_p = [s for s in prefills if s.datacenter != local and s.available]
        decodes = [s for s in snap.instances if s.role == "decode" and s.available]
        if not remote_p or not local_p or not decodes:
            return {**base, "status": "needs an available local prefill, remote prefill and decode instance"}
        if snap.kv_bytes_per_token is None or not link_gbps:
            return {**base, "status": "needs a measured transfer (KV bytes per token) and a link bandwidth"}
        assumed = self.routing.assumed_prefill_tokens_per_s
        local_tps = float(np.median([s.prefill_tokens_per_s or assumed for s in local_p]))
        remote_tps = float(np.median([s.prefill_tokens_per_s or assumed for s in remote_p]))
        bpt = snap.kv_bytes_per_token
        capacity = max(max(s.capacity for s in decodes), 1)
        decode = DecodeProfile(batch=np.array([1.0, float(capacity)]),
                               tpot_s=np.array([_UNBOUNDED_DECODE_TPOT_S] * 2),
                               slo_s=2 * _UNBOUNDED_DECODE_TPOT_S, output_len=1.0)
        try:
            setup = ClusterSetup(
                workload=EmpiricalWorkload(np.array(self.lengths, dtype=float), source="recent requests"),
                remote_prefill=PrefillProfile.from_tps(remote_tps), local_prefill=PrefillProfile.from_tps(local_tps),
                decode=decode, remote_instances=len(remote_p), local_instances=len(local_p) + len(decodes),
                link_gbps=link_gbps, kv_bytes=lambda lengths: np.asarray(lengths, dtype=float) * bpt)
            live = max((evaluate(setup, t, len(local_p)) for t in candidate_thresholds(setup.workload)),
                       key=lambda e: (e.throughput_rps, -e.offload_share))
        except PlanError as exc:
            return {**base, "status": f"planner: {exc}"}
        threshold = max(1, math.floor(live.threshold) + 1)  # the model offloads L > t; the policy L >= threshold
        lam = self.arrival_rate()
        recommended: dict[str, Any] = {"arrival_rate_rps": lam}
        if lam is not None:
            p = live.offload_share
            local_load = lam * (1 - p) / (live.local_prefill_rps / max(len(local_p), 1)) if live.local_prefill_rps else 0.0
            remote_rps = min(live.remote_compute_rps, math.inf) / max(len(remote_p), 1)
            remote_load = lam * p / remote_rps if p > 0 and remote_rps > 0 else 0.0
            recommended.update(
                local_prefill_instances=max(1, math.ceil(local_load / _TARGET_UTILISATION)),
                remote_prefill_instances=math.ceil(remote_load / _TARGET_UTILISATION),
                link_utilisation=lam * p * live.offload_mean_len * bpt * 8 / (link_gbps * 1e9),
                target_utilisation=_TARGET_UTILISATION)
        return {
            **base, "status": "ok",
            "inputs": {"local_prefill_tokens_per_s": local_tps, "remote_prefill_tokens_per_s": remote_tps,
                       "kv_bytes_per_token": bpt, "link_gbps": link_gbps,
                       "local_prefill_instances": len(local_p), "remote_prefill_instances": len(remote_p),
                       "decode_instances": len(decodes), "prompt_tokens_p50": float(np.median(self.lengths))},
            "live": {"threshold_tokens": threshold, **live.as_dict()},
            "recommended": recommended,
        }
