"""The offline queue for batch requests (M4, M5.4: "offline queue for batch jobs").

A batch request the policy defers (`Defer`: no spare remote capacity, the egress budget is spent)
waits here instead of being refused. Every time the scheduler's picture of the cluster changes (a
probe round), `retry` runs the policy again for the waiting requests, heaviest tenant first
(`routing.tenants.<t>.weight`), then oldest first; each one routed counts as pending on its
instances before the next is tried, so one free slot is not handed to everyone. A request that
waits longer than `routing.batch_max_wait_s` ends with 429 `batch_queue_timeout`; when
`routing.batch_queue_max` are waiting, a new one gets 429 `batch_queue_full` at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from crossfill.policy import Defer, NoRoute, Route


@dataclass(order=True)
class _Waiter:
    key: tuple[float, int]
    attempt: Callable[[], Route] = field(compare=False)  # runs decide; raises Defer to keep waiting
    result: asyncio.Future[Route] = field(compare=False)


class BatchQueue:
    def __init__(self, max_waiting: int, max_wait_s: float) -> None:
        self.max_waiting, self.max_wait_s = max_waiting, max_wait_s
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, weight: float, attempt: Callable[[], Route]) -> Route:
        """Wait until `attempt` routes the request; NoRoute (429) when full or after max_wait_s."""
        if len(self._waiting) >= self.max_waiting:
            raise NoRoute(429, "batch_queue_full",
                          f"the batch queue is full ({self.max_waiting} waiting; routing.batch_queue_max)")
        w = _Waiter((-weight, next(self._order)), attempt, asyncio.get_running_loop().create_future())
        self._waiting.append(w)
        try:
            async with asyncio.timeout(self.max_wait_s):
                return await asyncio.shield(w.result)
        except TimeoutError:
            raise NoRoute(429, "batch_queue_timeout",
                          f"no spare prefill capacity for this batch request within routing.batch_max_wait_s "
                          f"({self.max_wait_s:g} s)") from None
        finally:
            if w in self._waiting:
                self._waiting.remove(w)

    def retry(self) -> int:
        """Try every waiting request once, in priority order; returns how many were routed."""
        routed = 0
        for w in sorted(self._waiting):
            if w.result.done():
                continue
            try:
                w.result.set_result(w.attempt())
                routed += 1
            except Defer:
                continue
            except NoRoute as exc:
                w.result.set_exception(exc)
        self._waiting = [w for w in self._waiting if not w.result.done()]
        return routed
