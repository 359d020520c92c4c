"""Decode's client of a prefill instance: POST /v1/prefill and follow its typed event stream.

Silence longer than `timeout_s` fails the attempt (prefill sends `alive` heartbeats while it
waits or computes, so only a dead or cut-off prefill is silent that long).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from crossfill.serving.protocol import (
    Accepted,
    Alive,
    ErrorEvent,
    FirstToken,
    PrefillDone,
    PrefillJob,
    parse_prefill_event,
)


class AttemptFailed(Exception):
    """One attempt to get KV from a prefill instance failed; `retryable` says whether trying it again may help."""

    def __init__(self, reason: str, retryable: bool = True, status: int = 502) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.status = status


async def call_prefill(http: httpx.AsyncClient, url: str, job: PrefillJob, timeout_s: float,
                       on_first: Callable[[FirstToken | PrefillDone], None],
                       on_alive: Callable[[], None] | None = None,
                       trace_headers: dict[str, str] | None = None) -> PrefillDone:
    """Run `job` on the prefill at `url`; `on_first` gets the first token as soon as it is known,
    `on_alive` each sign of life before it (accepted, heartbeat while queued or computing).
    `trace_headers`: the attempt's W3C `traceparent`, so prefill's spans join the request's trace."""
    first_seen = False
    try:
        async with http.stream("POST", url + "/v1/prefill", content=job.model_dump_json(),
                               headers={"content-type": "application/json", **(trace_headers or {})},
                               timeout=httpx.Timeout(timeout_s, connect=timeout_s)) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                try:
                    msg = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = body[:200].decode(errors="replace")
                # A full, unready or refusing instance will not take it on retry either: move on.
                raise AttemptFailed(f"prefill answered HTTP {resp.status_code}: {msg}",
                                    retryable=resp.status_code >= 500 and resp.status_code != 503,
                                    status=resp.status_code)
            lines = resp.aiter_lines()
            while True:
                try:
                    line = await asyncio.wait_for(anext(lines), timeout_s)
                except StopAsyncIteration:
                    raise AttemptFailed("prefill stream ended without a result") from None
                except TimeoutError:
                    raise AttemptFailed(f"no word from prefill for kv_cache.timeout_ms "
                                        f"({int(timeout_s * 1000)} ms)") from None
                if not line:
                    continue
                ev = parse_prefill_event(line)
                if on_alive is not None and not first_seen and isinstance(ev, Accepted | Alive):
                    on_alive()
                if isinstance(ev, FirstToken | PrefillDone) and not first_seen:
                    first_seen = True
                    on_first(ev)
                if isinstance(ev, PrefillDone):
                    return ev
                if isinstance(ev, ErrorEvent):
                    raise AttemptFailed(f"prefill error: {ev.message}", retryable=ev.status >= 500, status=ev.status)
    except httpx.HTTPError as exc:
        raise AttemptFailed(f"prefill unreachable: {type(exc).__name__}: {exc}") from None
    except ValidationError as exc:
        raise AttemptFailed(f"prefill sent a malformed event: {exc.errors()[0]['msg']}") from None
