"""The retry and fallback order (crossfill.policy.attempts), tested alone: a pure function."""

from __future__ import annotations

from crossfill.policy.attempts import (
    AttemptPlan,
    Failure,
    GiveUp,
    TryPrefill,
    degradation_note,
    next_attempt,
)

PLAN = AttemptPlan(candidates=("far-0", "far-1", "here-0"), prefill_instances=frozenset({"far-0", "far-1", "here-0"}),
                   max_retry=1)


def test_first_try_is_the_routes_choice() -> None:
    assert next_attempt(PLAN, []) == TryPrefill("far-0", 0)


def test_retries_an_instance_max_retry_times_then_falls_back_in_order() -> None:
    f = [Failure("far-0", "cut")]
    assert next_attempt(PLAN, f) == TryPrefill("far-0", 0)
    f.append(Failure("far-0", "cut again"))
    assert next_attempt(PLAN, f) == TryPrefill("far-1", 1)
    f += [Failure("far-1", "x"), Failure("far-1", "y")]
    assert next_attempt(PLAN, f) == TryPrefill("here-0", 2)


def test_a_refusal_a_retry_cannot_change_moves_on_at_once() -> None:
    assert next_attempt(PLAN, [Failure("far-0", "not ready", 503, retryable=False)]) == TryPrefill("far-1", 1)


def test_names_that_are_not_prefill_instances_are_skipped_and_reported() -> None:
    plan = AttemptPlan(("ghost", "here-0"), frozenset({"here-0"}), max_retry=0)
    assert next_attempt(plan, []) == TryPrefill("here-0", 1)
    out = next_attempt(plan, [Failure("here-0", "boom")])
    assert isinstance(out, GiveUp) and out.status == 502 and out.code == "kv_transfer_failed"
    assert "ghost: not a prefill instance" in out.message and "here-0: boom" in out.message


def test_every_instance_full_is_backpressure_with_retry_after() -> None:
    plan = AttemptPlan(("far-0", "here-0"), frozenset({"far-0", "here-0"}), max_retry=2)
    full = [Failure("far-0", "queue full", 429, False), Failure("here-0", "queue full", 429, False)]
    out = next_attempt(plan, full)
    assert out == GiveUp(429, "prefill_queue_full", out.message, retry_after=True)


def test_give_up_names_the_policy_when_local_fallback_is_off() -> None:
    plan = AttemptPlan(("far-0",), frozenset({"far-0"}), max_retry=0, fallback_to_local=False)
    out = next_attempt(plan, [Failure("far-0", "cut")])
    assert isinstance(out, GiveUp) and "fallback_to_local_on_failure is false" in out.message


def test_degradation_note_says_what_happened() -> None:
    assert degradation_note(PLAN, [], TryPrefill("far-0", 0), "remote") is None
    f = [Failure("far-0", "cut")]
    assert "after 1 failed attempt" in (degradation_note(PLAN, f, TryPrefill("far-0", 0), "remote") or "")
    note = degradation_note(PLAN, f * 2, TryPrefill("here-0", 2), "local") or ""
    assert note.startswith("prefill far-0 failed") and "fell back to local prefill here-0" in note
