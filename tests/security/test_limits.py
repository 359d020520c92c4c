"""Abuse limits with an injected clock: request rate, token quota, concurrent streams, audit throttling."""

from __future__ import annotations

import pytest

from crossfill.config import LimitsConfig, TenantLimitsConfig
from crossfill.security.limits import AuditThrottle, LimitExceeded, TenantLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _limiter(**limits: object) -> tuple[TenantLimiter, Clock]:
    clock = Clock()
    base = {"requests_per_minute": None, "tokens_per_minute": None, "max_concurrent_streams": None}
    cfg = LimitsConfig(default=TenantLimitsConfig(**{**base, **limits}),  # type: ignore[arg-type]
                       tenants={"big": TenantLimitsConfig(**base)})  # type: ignore[arg-type]
    return TenantLimiter(cfg, clock=clock), clock


def test_requests_per_minute_refuses_with_the_wait_and_refills() -> None:
    lim, clock = _limiter(requests_per_minute=2)
    lim.admit("a", 1)()
    lim.admit("a", 1)()
    with pytest.raises(LimitExceeded) as exc:
        lim.admit("a", 1)
    assert exc.value.status == 429 and exc.value.code == "rate_limited" and exc.value.retry_after == 30
    lim.admit("b", 1)()  # another tenant has its own bucket
    lim.admit("big", 1)()  # and an override
    clock.t += 30
    lim.admit("a", 1)()


def test_token_quota_counts_prompt_plus_max_tokens() -> None:
    lim, clock = _limiter(tokens_per_minute=600)
    lim.admit("a", 500)()
    with pytest.raises(LimitExceeded) as exc:
        lim.admit("a", 200)
    # 100 tokens left, 10 per second come back: 100 more in 10 s.
    assert exc.value.code == "token_quota_exceeded" and exc.value.retry_after == 10
    clock.t += 10
    lim.admit("a", 200)()
    with pytest.raises(LimitExceeded) as never:
        lim.admit("a", 601)  # more than a whole minute's quota: no wait would help
    assert never.value.status == 400 and never.value.param == "max_tokens"


def test_a_refused_request_consumes_nothing() -> None:
    lim, _ = _limiter(requests_per_minute=1, tokens_per_minute=100)
    with pytest.raises(LimitExceeded):
        lim.admit("a", 101)
    lim.admit("a", 100)()  # the refusal above took neither the request nor its tokens


def test_concurrent_streams_held_until_released() -> None:
    lim, _ = _limiter(max_concurrent_streams=2)
    r1, r2 = lim.admit("a", 1), lim.admit("a", 1)
    with pytest.raises(LimitExceeded) as exc:
        lim.admit("a", 1)
    assert exc.value.code == "too_many_streams" and exc.value.retry_after == 1
    r1()
    r1()  # a second release of the same request changes nothing
    assert lim.streams("a") == 1
    lim.admit("a", 1)
    r2()


def test_audit_throttle_one_per_key_per_second_and_counts_the_rest() -> None:
    clock = Clock()
    th = AuditThrottle(burst=1, per_s=1, clock=clock)
    assert th.allow("t") == 0
    assert th.allow("t") is None and th.allow("t") is None
    assert th.allow("u") == 0
    clock.t += 1
    assert th.allow("t") == 2  # the next record says how many were held back


def test_the_tenant_table_stays_bounded_and_keeps_tenants_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """With auth off any body names a tenant: a stream of new names must not grow memory without end."""
    monkeypatch.setattr(TenantLimiter, "_MAX_TENANTS", 50)
    lim, _ = _limiter(max_concurrent_streams=1)
    held = lim.admit("busy", 1)  # in flight across the purge: its stream count must survive
    for i in range(500):
        lim.admit(f"t{i}", 1)()
    assert len(lim._tenants) <= 50
    with pytest.raises(LimitExceeded, match="in flight"):
        lim.admit("busy", 1)
    held()
    lim.admit("busy", 1)()
