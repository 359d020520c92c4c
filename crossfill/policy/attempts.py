"""The retry and fallback order for getting a request's KV: a pure function, beside the routing policy.

Decode asks `next_attempt(plan, failures)` before every attempt and gets either the prefill
instance to try next or the explicit error to answer with. The order (M5.8): the route's prefill
up to 1 + `kv_cache.max_retry` times, then each fallback the route lists (other remote pools, then
local prefill when `fallback_to_local_on_failure`) the same way; an instance that refuses in a way
a retry cannot change (full queue, not ready, bad request) is left at once. Keeping this out of the
worker lets it be tested alone and read in one place, as vLLM keeps `kv_load_failure_policy` a
named setting rather than a loop in a handler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AttemptPlan:
    candidates: tuple[str, ...]  # the route's prefill first, then its fallbacks in order
    prefill_instances: frozenset[str]  # names that are prefill instances (anything else is skipped)
    max_retry: int
    fallback_to_local: bool = True


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as decode saw it."""

    instance: str
    reason: str
    status: int = 502  # 429: queue full, 503: not ready, 4xx: refused, 5xx: failed
    retryable: bool = True


@dataclass(frozen=True)
class TryPrefill:
    instance: str
    index: int  # position in plan.candidates (0: the route's own choice)


@dataclass(frozen=True)
class GiveUp:
    status: int
    code: str
    message: str
    retry_after: bool = False  # answer with Retry-After (backpressure, not a failure)


def next_attempt(plan: AttemptPlan, failures: Sequence[Failure]) -> TryPrefill | GiveUp:
    """The next prefill to try after `failures` (in order), or why to stop."""
    for index, name in enumerate(plan.candidates):
        if name not in plan.prefill_instances:
            continue
        mine = [f for f in failures if f.instance == name]
        if any(not f.retryable for f in mine) or len(mine) >= 1 + plan.max_retry:
            continue
        return TryPrefill(name, index)
    return _give_up(plan, failures)


def _give_up(plan: AttemptPlan, failures: Sequence[Failure]) -> GiveUp:
    if failures and all(f.status == 429 for f in failures):
        return GiveUp(429, "prefill_queue_full", "every prefill instance on the route has a full queue: "
                      + "; ".join(_describe(f) for f in failures), retry_after=True)
    skipped = [n for n in plan.candidates if n not in plan.prefill_instances]
    notes = [f"{n}: not a prefill instance" for n in skipped] + [_describe(f) for f in failures]
    policy_note = "" if plan.fallback_to_local else " (fallback_to_local_on_failure is false)"
    return GiveUp(502, "kv_transfer_failed", f"could not get the KV cache after {len(failures)} attempt(s)"
                  f"{policy_note}: " + "; ".join(notes[-4:]))


def degradation_note(plan: AttemptPlan, failures: Sequence[Failure], served: TryPrefill, where: str) -> str | None:
    """Why the KV came from somewhere other than the route's first try (None: it did not)."""
    if not failures:
        return None
    last = _describe(failures[-1])
    if served.index > 0:
        return f"prefill {plan.candidates[0]} failed ({last}); fell back to {where} prefill {served.instance}"
    return f"{last}; served by {where} prefill {served.instance} after {len(failures)} failed attempt(s)"


def _describe(f: Failure) -> str:
    return f"{f.instance}: {f.reason}"
