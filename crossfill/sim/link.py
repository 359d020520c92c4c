"""The inter-DC link as a SimPy resource: processor sharing of a fluctuating bandwidth.

Every active KV transfer gets an equal share of the link's current capacity (TCP flows sharing a
bottleneck, roughly). Processor sharing is simulated with a virtual clock V: it advances at
capacity / active transfers bytes per second, and a transfer of b bytes started at V0 finishes
when V reaches V0 + b. Finishing order is therefore a heap on V0 + b, and each start, finish or
capacity change costs O(log n), however many transfers share the link.

Capacity = `gbps` x a factor that changes every `step_s` (sinusoid or bounded random walk), and 0
during outage windows, when the link is also reported down and every active transfer fails (the
connection breaks; the cluster decides what to do with it). Bytes served are accumulated per
one-second bucket for the utilisation report and the egress rate routing sees.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass

import simpy

_BUCKET_S = 1.0  # utilisation sampling period
_EGRESS_WINDOW_S = 10  # buckets averaged for LinkState.egress_bytes_per_s


@dataclass(frozen=True)
class Fluctuation:
    kind: str = "none"  # "none" | "sine" | "random_walk"
    amplitude: float = 0.0  # sine: factor = 1 + amplitude x sin(2 pi t / period_s)
    period_s: float = 600.0
    step_s: float = 1.0  # how often the factor changes
    sigma: float = 0.05  # random walk: std-dev of ln(factor) per step
    floor: float = 0.1  # random walk: factor bounds
    ceiling: float = 1.0


@dataclass(frozen=True)
class LinkSpec:
    gbps: float
    rtt_ms: float = 10.0
    fluctuation: Fluctuation = Fluctuation()
    outages: tuple[tuple[float, float], ...] = ()  # (start_s, duration_s)

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0


class Transfer:
    __slots__ = ("request", "bytes", "finish_v", "alive", "started")

    def __init__(self, request: int, size: float, finish_v: float, started: float) -> None:
        self.request, self.bytes, self.finish_v, self.alive, self.started = request, size, finish_v, True, started


class SharedLink:
    def __init__(self, env: simpy.Environment, spec: LinkSpec, on_done: Callable[[Transfer, bool], None],
                 rng: random.Random) -> None:
        self.env, self.spec, self.on_done, self.rng = env, spec, on_done, rng
        self.nominal_bps = spec.gbps * 1e9 / 8  # bytes per second
        self.factor = 1.0
        self.up = True
        self.v = 0.0
        self.t_last = 0.0
        self.active = 0
        self.heap: list[tuple[float, int, Transfer]] = []
        self.seq = 0
        self.timer_gen = 0
        self.served: list[float] = []  # bytes per bucket

    # -- state routing reads -------------------------------------------------------------------
    @property
    def bandwidth_gbps(self) -> float:
        """What a link monitor would measure now."""
        return self.spec.gbps * self.factor

    def egress_bytes_per_s(self) -> float:
        b = int(self.env.now / _BUCKET_S)
        lo = max(0, b - _EGRESS_WINDOW_S)
        window = self.served[lo:b]
        return sum(window) / (_EGRESS_WINDOW_S * _BUCKET_S) if window else 0.0

    # -- transfers ----------------------------------------------------------------------------
    def start(self, request: int, size: float) -> Transfer | None:
        """Begin sending `size` bytes; None when the link is down (the caller falls back)."""
        if not self.up:
            return None
        self._advance()
        tr = Transfer(request, size, self.v + size, self.env.now)
        self.seq += 1
        heapq.heappush(self.heap, (tr.finish_v, self.seq, tr))
        self.active += 1
        self._reschedule()
        return tr

    def cancel(self, tr: Transfer) -> None:
        if not tr.alive:
            return
        self._advance()
        tr.alive = False  # its heap entry is skipped when it surfaces
        self.active -= 1
        self._reschedule()

    # -- capacity over time --------------------------------------------------------------------
    def run_capacity(self, until_idle: Callable[[], bool]) -> Generator[simpy.events.Event, None, None]:
        """SimPy process: move the factor every step_s and open/close outage windows."""
        f = self.spec.fluctuation
        outages = sorted(self.spec.outages)
        walk = 1.0
        while not until_idle():
            t = self.env.now
            down = any(s <= t < s + d for s, d in outages)
            if f.kind == "sine":
                factor = 1.0 + f.amplitude * math.sin(2 * math.pi * t / f.period_s)
            elif f.kind == "random_walk":
                walk = min(f.ceiling, max(f.floor, walk * math.exp(self.rng.gauss(0.0, f.sigma))))
                factor = walk
            else:
                factor = 1.0
            self._set(0.0 if down else factor, not down)
            step = f.step_s if f.kind != "none" else math.inf
            upcoming = [s for s, _ in outages if s > t] + [s + d for s, d in outages if s + d > t]
            nxt = min([step, *(u - t for u in upcoming)])
            if math.isinf(nxt):
                return
            yield self.env.timeout(nxt)

    def _set(self, factor: float, up: bool) -> None:
        self._advance()
        self.factor = factor
        was_up, self.up = self.up, up
        if was_up and not up:
            broken = [tr for _, _, tr in self.heap if tr.alive]
            self.heap.clear()
            self.active = 0
            for tr in broken:
                tr.alive = False
                self.on_done(tr, False)
        self._reschedule()

    # -- processor sharing ---------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        dt = now - self.t_last
        if dt <= 0:
            return
        rate = self.nominal_bps * self.factor
        if self.active > 0 and rate > 0:
            self.v += rate * dt / self.active
            self._account(self.t_last, now, rate)
        self.t_last = now

    def _account(self, t0: float, t1: float, rate: float) -> None:
        served = self.served
        b0, b1 = int(t0 / _BUCKET_S), int(t1 / _BUCKET_S)
        if len(served) <= b1:
            served.extend([0.0] * (b1 + 1 - len(served)))
        if b0 == b1:
            served[b0] += rate * (t1 - t0)
            return
        served[b0] += rate * ((b0 + 1) * _BUCKET_S - t0)
        for b in range(b0 + 1, b1):
            served[b] += rate * _BUCKET_S
        served[b1] += rate * (t1 - b1 * _BUCKET_S)

    def _reschedule(self) -> None:
        heap = self.heap
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
        self.timer_gen += 1
        rate = self.nominal_bps * self.factor
        if not heap or rate <= 0:
            return
        delay = max(0.0, (heap[0][0] - self.v) * self.active / rate)
        ev = simpy.events.Timeout(self.env, delay, self.timer_gen)
        ev.callbacks.append(self._on_timer)

    def _on_timer(self, ev: simpy.events.Event) -> None:
        if ev.value != self.timer_gen:
            return  # superseded by a later start, cancel or capacity change
        self._advance()
        heap = self.heap
        done: list[Transfer] = []
        # Relative tolerance: V is a sum of many float increments.
        limit = self.v + 1e-9 * max(1.0, abs(self.v))
        while heap and (not heap[0][2].alive or heap[0][0] <= limit):
            _, _, tr = heapq.heappop(heap)
            if tr.alive:
                tr.alive = False
                self.active -= 1
                done.append(tr)
        self._reschedule()
        for tr in done:
            self.on_done(tr, True)
