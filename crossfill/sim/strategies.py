"""The routing strategies compared side by side, all driven by the same `decide`.

Each is a cluster layout (how many remote prefill, local prefill and decode instances) plus what
the simulated scheduler hands to `decide`: the config, the request's `prefill_policy`, whether
`cached_tokens` is filled, and the live threshold. Where `decide` has no switch for a strategy,
the strategy is made by changing its inputs, and `notes` says how.

- `homogeneous-pd`: every instance (remote and local counts together) of the local hardware class
  in one datacenter, split between prefill and decode as the planner's `local_only` says.
- `naive-remote`: every request prefilled remotely (`prefill_policy: remote_required`); every
  local instance decodes (the paper's naive heterogeneous deployment).
- `threshold-only`: the config's fixed threshold, `bandwidth_aware` off, no cache awareness.
- `full-policy`: the live policy with everything on; the threshold and the local split are the
  planner's optimum (what the scheduler's re-tune derives with `pin_threshold: false`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from crossfill.config import InferenceServiceConfig
from crossfill.planner.errors import PlanError
from crossfill.planner.optimizer import ClusterSetup, Evaluation, evaluate, local_only, optimize
from crossfill.policy.routing import PrefillPolicy
from crossfill.sim.simfile import SimSpec


@dataclass(frozen=True)
class Strategy:
    name: str
    remote_instances: int
    local_prefill: int
    decode: int
    config: InferenceServiceConfig
    policy: PrefillPolicy
    cache_aware: bool
    threshold_tokens: int | None  # Snapshot.threshold_tokens (None: the config's)
    analytic: Evaluation | None  # the planner's capacity for this layout and threshold
    notes: tuple[str, ...] = ()

    @property
    def instances(self) -> int:
        return self.remote_instances + self.local_prefill + self.decode


def build_strategies(spec: SimSpec) -> tuple[list[Strategy], list[str]]:
    """The strategies `spec` asks for, and a note for each one that cannot run on this cluster."""
    makers = {"homogeneous-pd": _homogeneous, "naive-remote": _naive, "threshold-only": _threshold_only,
              "full-policy": _full}
    out, skipped = [], []
    for name in spec.strategies:
        s = makers[name](spec)
        if isinstance(s, str):
            skipped.append(f"{name}: {s}")
        else:
            out.append(s)
    return out, skipped


def _best_split(setup: ClusterSetup, threshold: float, pinned: int | None) -> Evaluation:
    if pinned is not None:
        return evaluate(setup, threshold, pinned)
    return max((evaluate(setup, threshold, n) for n in range(setup.local_instances)),
               key=lambda e: (e.throughput_rps, e.decode_instances))


def _homogeneous(spec: SimSpec) -> Strategy:
    total = spec.setup.remote_instances + spec.setup.local_instances
    ev = local_only(replace(spec.setup, remote_instances=0, local_instances=total))
    return Strategy("homogeneous-pd", 0, ev.local_prefill_instances, ev.decode_instances, spec.config, "auto",
                    True, None, ev,
                    (f"all {total} instances as {spec.local_hardware} in one datacenter, split by the planner's local_only",))


def _naive(spec: SimSpec) -> Strategy | str:
    setup = spec.setup
    if setup.remote_instances == 0:
        return "no remote pool (pools.remote.instances is 0)"
    ev = evaluate(setup, 0.0, 0)
    return Strategy("naive-remote", setup.remote_instances, 0, setup.local_instances, spec.config, "remote_required",
                    True, None, ev,
                    ("prefill_policy remote_required on every request (decide has no naive mode); "
                     "every local instance decodes",))


def _threshold_only(spec: SimSpec) -> Strategy:
    routing = spec.config.routing.model_copy(update={"bandwidth_aware": False, "pin_threshold": True})
    config = spec.config.model_copy(update={"routing": routing})
    t = routing.long_context_threshold_tokens
    ev = _split_or_none(spec, t)
    n_prefill = ev.local_prefill_instances if ev else max(1, spec.setup.local_instances // 2)
    return Strategy("threshold-only", spec.setup.remote_instances, n_prefill, spec.setup.local_instances - n_prefill,
                    config, "auto", False, None, ev,
                    (f"fixed threshold {t} tokens, bandwidth_aware off; no cached_tokens passed to decide "
                     "(it has no switch for cache awareness; the caches still save compute by chance)",))


def _full(spec: SimSpec) -> Strategy:
    routing = spec.config.routing
    setup = spec.setup
    if routing.pin_threshold or setup.remote_instances == 0:
        t = routing.long_context_threshold_tokens
        ev = _split_or_none(spec, t)
        live, why = None, f"pinned threshold {t} tokens (routing.pin_threshold)"
    else:
        best, _ = optimize(setup)
        # The planner offloads L > t; decide offloads incremental tokens >= threshold.
        t = math.floor(best.threshold) + 1
        ev = best if spec.local_prefill_instances is None else _split_or_none(spec, t)
        live, why = t, f"threshold {t} tokens from the planner's optimum (the scheduler's re-tune, done once)"
    n_prefill = ev.local_prefill_instances if ev else max(1, setup.local_instances // 2)
    return Strategy("full-policy", setup.remote_instances, n_prefill, setup.local_instances - n_prefill, spec.config,
                    "auto", True, live, ev, (why,))


def _split_or_none(spec: SimSpec, decide_threshold: int) -> Evaluation | None:
    try:
        return _best_split(spec.setup, decide_threshold - 1, spec.local_prefill_instances)
    except PlanError:
        return None
