"""Abuse limits at the gateway: per-tenant rates, concurrent streams, request body size and speed.

- `TenantLimiter`: per tenant (`security.limits.default`, overridden per tenant in
  `security.limits.tenants`) a token bucket of requests per minute, one of tokens per minute
  (prompt tokens + max_tokens: what a request may cost, known before it runs) and a count of
  requests in flight ("streams", held from admission until the response, streamed or not, has
  finished). A request is admitted by all three or by none (a refusal consumes nothing); a
  refusal is a 429 whose Retry-After says when the bucket will have room.
- `BodyLimits`: ASGI middleware refusing a body over `max_bytes` (413, by its Content-Length
  before reading anything, or while counting the bytes of a chunked body) and a body not fully
  received within `client_body_timeout_s` of the request's start (408): a slow client cannot
  hold a connection and a handler open forever.
- `AuditThrottle`: refusals are audited, but a flood of them must not flood the audit log.

Clocks are injected (monotonic seconds), so the tests step time instead of sleeping.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crossfill.config import LimitsConfig, TenantLimitsConfig
from crossfill.serving.errors import APIError

Clock = Callable[[], float]


class TokenBucket:
    """`capacity` units, refilled at `per_s` units per second, starting full."""

    def __init__(self, capacity: float, per_s: float, now: float) -> None:
        self.capacity = capacity
        self.per_s = per_s
        self.level = capacity
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until `n` units are available (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= n else (n - self.level) / self.per_s

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.level -= n


@dataclass
class _Tenant:
    limits: TenantLimitsConfig
    requests: TokenBucket | None
    tokens: TokenBucket | None
    streams: int = 0


class LimitExceeded(APIError):
    """A 429 (or the 400 of a request no quota could ever admit) with the limit that refused it."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None, param: str | None = None) -> None:
        super().__init__(status, message, code=code, retry_after=retry_after, param=param)


class TenantLimiter:
    def __init__(self, cfg: LimitsConfig, clock: Clock = time.monotonic, stream_retry_after_s: int = 1) -> None:
        self.cfg = cfg
        self.clock = clock
        # Nobody can say when another tenant's stream ends: retry after the service's usual pause.
        self.stream_retry_after_s = stream_retry_after_s
        self._tenants: dict[str, _Tenant] = {}

    # With auth off the tenant is whatever a body says, so the table must not grow without end;
    # forgetting idle tenants only refills their buckets early (a client choosing its tenant name
    # can dodge per-tenant limits anyway: that is what keys are for).
    _MAX_TENANTS = 10_000

    def _tenant(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            if len(self._tenants) >= self._MAX_TENANTS:
                self._tenants = {name: held for name, held in self._tenants.items() if held.streams}
            lim, now = self.cfg.tenant(tenant), self.clock()
            rpm, tpm = lim.requests_per_minute, lim.tokens_per_minute
            t = self._tenants[tenant] = _Tenant(
                lim,
                TokenBucket(rpm, rpm / 60, now) if rpm is not None else None,
                TokenBucket(tpm, tpm / 60, now) if tpm is not None else None)
        return t

    def admit(self, tenant: str, cost_tokens: int) -> Callable[[], None]:
        """Admit one request of `tenant` costing `cost_tokens`; returns its release (call it once, when
        the response has finished). Raises LimitExceeded naming the limit that refused it."""
        t, now = self._tenant(tenant), self.clock()
        lim = t.limits
        if t.tokens is not None and cost_tokens > t.tokens.capacity:
            raise LimitExceeded(400, f"this request may use {cost_tokens} tokens (prompt + max_tokens), more than "
                                f"the tenant's whole quota of {lim.tokens_per_minute} tokens per minute; lower "
                                "max_tokens or shorten the prompt", "token_quota_exceeded", None, param="max_tokens")
        if t.requests is not None and (wait := t.requests.wait_s(1, now)) > 0:
            raise LimitExceeded(429, f"rate limit of {lim.requests_per_minute:g} requests per minute reached for "
                                f"tenant {tenant!r}; retry in {math.ceil(wait)} s", "rate_limited", math.ceil(wait))
        if t.tokens is not None and (wait := t.tokens.wait_s(cost_tokens, now)) > 0:
            raise LimitExceeded(429, f"token quota of {lim.tokens_per_minute} tokens per minute (prompt + max_tokens) "
                                f"reached for tenant {tenant!r}; this request needs {cost_tokens}, retry in "
                                f"{math.ceil(wait)} s", "token_quota_exceeded", math.ceil(wait))
        if lim.max_concurrent_streams is not None and t.streams >= lim.max_concurrent_streams:
            raise LimitExceeded(429, f"tenant {tenant!r} already has {t.streams} requests in flight, its limit "
                                f"(max_concurrent_streams); retry when one has finished", "too_many_streams",
                                self.stream_retry_after_s)
        if t.requests is not None:
            t.requests.take(1, now)
        if t.tokens is not None:
            t.tokens.take(cost_tokens, now)
        t.streams += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                t.streams -= 1

        return release

    def streams(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return 0 if t is None else t.streams


class AuditThrottle:
    """At most `burst` records per key at once, refilled at `per_s`; counts what it held back.

    `allow(key)` returns None when this record must be dropped, else how many were dropped for
    this key since the last allowed one (written into the record, so the log still tells the size).
    """

    _MAX_KEYS = 10_000  # forget idle keys beyond this many (a flood from many addresses)

    def __init__(self, burst: float = 1.0, per_s: float = 1.0, clock: Clock = time.monotonic) -> None:
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self._buckets: dict[str, TokenBucket] = {}
        self._dropped: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        now = self.clock()
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self._MAX_KEYS:
                self._forget_idle(now)
            b = self._buckets[key] = TokenBucket(self.burst, self.per_s, now)
        if b.wait_s(1, now) > 0:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return None
        b.take(1, now)
        return self._dropped.pop(key, 0)

    def _forget_idle(self, now: float) -> None:
        for k in [k for k, b in self._buckets.items() if b.wait_s(self.burst, now) == 0 and k not in self._dropped]:
            del self._buckets[k]


# --------------------------------------------------------------------------- request bodies


class BodyRefused(APIError):
    """A 408/413 sent while the body is unread or half read: the connection closes after it, as the
    rest of the body would otherwise still have to be received (from a client that stalls)."""

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Connection": "close"}


class BodyLimits:
    """ASGI middleware: 413 for a body over `max_bytes`, 408 for one not received within `timeout_s`."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            # Refused before a byte of the body is read. The connection closes after the answer
            # (the body was never read), so the client cannot go on sending into it.
            err = self.too_large() if length.isdigit() else BodyRefused(400, "Content-Length is not a number",
                                                                         code="invalid_request")
            await _send_error(send, err)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        received = 0
        body_done = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, body_done
            if body_done:
                return await receive()  # after the body: disconnect waits, no deadline
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyRefused(408, f"the request body was not received within {self.timeout_s:g} s "
                               "(security.limits.client_body_timeout_s)", code="request_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large()
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    def too_large(self) -> APIError:
        return BodyRefused(413, f"the request body is larger than {self.max_bytes} bytes (security.limits.max_body_bytes)",
                        code="request_too_large")


async def _send_error(send: Any, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in err.headers().items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
