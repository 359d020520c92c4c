"""The slow timescale of routing: re-derive the long-prompt threshold from what the cluster sees.

Per request the policy routes (fast timescale). Every `routing.retune_interval_s` the scheduler
feeds the planner's PrfaaS throughput model (`crossfill.planner.optimizer`) with what it observed:
the prompt lengths of recent requests (an empirical workload), each pool's measured prefill
tokens/s, the link's bandwidth estimate and the KV wire bytes per token. Two answers come back:

- the live threshold: the one that maximises cluster throughput with the instances running now
  (local prefill count fixed); `auto` uses it unless `routing.pin_threshold` is true;
- recommended instance counts: the best split of the local instances between prefill and decode
  (`optimize`), for an operator or an autoscaler to act on.

Both are shown at `GET /v1/admin/plan` with their inputs. Decode capacity is not measured by the
scheduler, so the model gets a decode pool that is not the bottleneck (assumed TPOT, stated in the
answer); the threshold is a balance between local prefill, remote prefill and the link, which
decode does not move. Until `min_samples` lengths have been seen, the configured threshold stays.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from crossfill.config import CrossfillConfig
from crossfill.planner.errors import PlanError
from crossfill.planner.optimizer import ClusterSetup, candidate_thresholds, evaluate, optimize
from crossfill.planner.profiles import DecodeProfile, PrefillProfile
from crossfill.planner.workload import EmpiricalWorkload
from crossfill.policy import Snapshot

_ASSUMED_TPOT_S = 0.05
_ASSUMED_OUTPUT_TOKENS = 128


class Retuner:
    def __init__(self, cfg: CrossfillConfig, *, window: int = 5000, min_samples: int = 100) -> None:
        self.cfg = cfg
        self.routing = cfg.inference_service.routing
        self.lengths: deque[int] = deque(maxlen=window)
        self.min_samples = min_samples
        self.threshold: int | None = None  # the live value; None: the configured one
        self.last: dict[str, Any] = {"status": "no plan yet", "samples": 0}

    def observe(self, prompt_tokens: int) -> None:
        if prompt_tokens > 0:
            self.lengths.append(prompt_tokens)

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
        decode = DecodeProfile(batch=np.array([1.0, float(capacity)]), tpot_s=np.array([_ASSUMED_TPOT_S] * 2),
                               slo_s=2 * _ASSUMED_TPOT_S, output_len=_ASSUMED_OUTPUT_TOKENS)
        try:
            setup = ClusterSetup(
                workload=EmpiricalWorkload(np.array(self.lengths, dtype=float), source="recent requests"),
                remote_prefill=PrefillProfile.from_tps(remote_tps), local_prefill=PrefillProfile.from_tps(local_tps),
                decode=decode, remote_instances=len(remote_p), local_instances=len(local_p) + len(decodes),
                link_gbps=link_gbps, kv_bytes=lambda lengths: np.asarray(lengths, dtype=float) * bpt)
            live = max((evaluate(setup, t, len(local_p)) for t in candidate_thresholds(setup.workload)),
                       key=lambda e: (e.throughput_rps, -e.offload_share))
            best, _ = optimize(setup)
        except PlanError as exc:
            return {**base, "status": f"planner: {exc}"}
        threshold = max(1, math.floor(live.threshold) + 1)  # the model offloads L > t; the policy L >= threshold
        return {
            **base, "status": "ok",
            "inputs": {"local_prefill_tokens_per_s": local_tps, "remote_prefill_tokens_per_s": remote_tps,
                       "kv_bytes_per_token": bpt, "link_gbps": link_gbps,
                       "local_prefill_instances": len(local_p), "remote_prefill_instances": len(remote_p),
                       "decode_instances": len(decodes),
                       "prompt_tokens_p50": float(np.median(self.lengths)),
                       "assumed": {"decode_tpot_s": _ASSUMED_TPOT_S, "output_tokens": _ASSUMED_OUTPUT_TOKENS}},
            "live": {"threshold_tokens": threshold, **live.as_dict()},
            "recommended": {"threshold_tokens": max(1, math.floor(best.threshold) + 1),
                            "local_prefill_instances": best.local_prefill_instances,
                            "decode_instances": best.decode_instances,
                            "remote_prefill_instances": best.remote_instances,
                            "throughput_rps": best.throughput_rps, "bottleneck": best.bottleneck},
        }
