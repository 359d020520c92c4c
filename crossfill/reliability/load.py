"""Steady closed-loop load: N clients, each sending one job (a request, or a chat's turns) after another.

The counters are what scenarios wait on instead of sleeping: how many requests completed (in
total or since a moment), how many streams are between their first token and their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import httpx

from crossfill.reliability.client import Outcome, new_client, send
from crossfill.reliability.workload import RequestSpec

# A client told "no" waits before its next request: what Retry-After asks (at most 5 s), else 0.5 s.
_PAUSE_AFTER_FAILURE_S = 0.5
_MAX_PAUSE_S = 5.0


class LoadGenerator:
    def __init__(self, url: str, model: str, next_job: Callable[[], list[RequestSpec]], concurrency: int,
                 deadline_s: float, connect_budget_s: float, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key  # sent as `Authorization: Bearer` when the gateway takes API keys
        self.model = model
        self.next_job = next_job
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.connect_budget_s = connect_budget_s
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.streams_mid = 0  # streams that delivered a token and have not ended yet
        self._mid: set[str] = set()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None
        self._changed = asyncio.Event()  # set whenever a request ends: waiters re-check their condition

    async def start(self) -> None:
        self._http = new_client(self.deadline_s, self.api_key)
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.concurrency)]

    async def stop(self) -> list[Outcome]:
        """Send nothing new; wait for what is in flight (each bounded by its deadline)."""
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        if self._http is not None:
            await self._http.aclose()
        return self.outcomes

    def completed_since(self, t: float) -> int:
        return sum(o.verdict == "completed" and o.started >= t for o in self.outcomes)

    def count(self, predicate: Callable[[Outcome], bool]) -> int:
        return sum(predicate(o) for o in self.outcomes)

    async def changed(self, timeout: float) -> None:
        """Return when a request ended, or after `timeout` seconds (for conditions on other things)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)
        self._changed.clear()

    async def _client(self) -> None:
        assert self._http is not None
        while not self._stopping.is_set():
            for spec in self.next_job():
                if self._stopping.is_set():
                    break
                out = await self._one(spec)
                if out.verdict != "completed":
                    pause = min(out.retry_after_s or _PAUSE_AFTER_FAILURE_S, _MAX_PAUSE_S)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), pause)
                    break  # a chat whose turn failed does not go on

    async def _one(self, spec: RequestSpec) -> Outcome:
        assert self._http is not None
        self.in_flight += 1
        try:
            out = await send(self._http, self.url, self.model, spec, deadline_s=self.deadline_s,
                             connect_budget_s=self.connect_budget_s, on_token=self._first_token)
        finally:
            self.in_flight -= 1
            if spec.request_id in self._mid:
                self._mid.discard(spec.request_id)
                self.streams_mid -= 1
        self.outcomes.append(out)
        self._changed.set()
        return out

    def _first_token(self, spec: RequestSpec) -> None:
        self._mid.add(spec.request_id)
        self.streams_mid += 1
        self._changed.set()


async def until(what: str, check: Callable[[], object], timeout: float, every: float = 0.1,
                load: LoadGenerator | None = None) -> None:
    """Wait until `check()` (sync or async) is true; its exceptions count as false. `timeout` is a
    safety net only: raises TimeoutError naming `what` when it passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ok = check()
            if asyncio.iscoroutine(ok):
                ok = await ok
        except (httpx.HTTPError, ValueError, KeyError, OSError):
            ok = False
        if ok:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f}s: {what}")
        if load is not None:
            await load.changed(every)
        else:
            await asyncio.sleep(every)
