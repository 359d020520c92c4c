"""One simulated run: SimPy events moving requests through a cluster laid out by a strategy.

A request's life, each arrow one scheduled event:

    arrival -> route (`decide` on a candidate snapshot)
      local:  prefill queue (FIFO) -> prefill -> decode
      remote: prefill queue -> prefill, with the KV streamed over the shared link while it
              computes -> KV at decode after both finish (+ one-way latency) -> decode
    decode: a batch slot (continuous batching, at most max_batch) -> first token after one step
            -> done after output tokens x the step time of the batch it joined.

Refusals follow the live services: `Defer` puts a batch request in the batch queue, retried when
prefill capacity frees (and every second), until `batch_max_wait_s`; another `NoRoute` (429/503)
is retried by the gateway with doubling back-off until `gateway.retry_budget_s`, then counted as
an error. A transfer that fails is re-sent up to `kv_cache.max_retry` times, then the request is
prefilled again on the route's first local fallback (`fallback_to_local_on_failure`); a crashed
remote instance hands its queue to each route's next available fallback; a link outage breaks
every transfer in flight (straight to the local fallback: the link is down).

Approximations, chosen to keep per-event work small: prefill runs one prompt at a time (the
planner's profile is measured that way); a request's TPOT is the step time at the batch it joins;
KV transfers start with the prefill and share the link from their first byte.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

import simpy
from simpy.events import Event, Timeout

from crossfill.policy import Defer, NoRoute, Route, decide
from crossfill.sim.cache import HolderIndex
from crossfill.sim.instances import DecodeInstance, PrefillInstance
from crossfill.sim.link import SharedLink, Transfer
from crossfill.sim.simfile import SimSpec
from crossfill.sim.snapshot import LOCAL_DC, REMOTE_DC, CandidatePolicy, SnapshotBuilder
from crossfill.sim.strategies import Strategy
from crossfill.sim.workload import Requests

_NONE, _LOCAL, _REMOTE = 0, 1, 2
_MAX_BACKOFF_S = 8.0
_BATCH_TRIES = 4  # deferred batch requests tried per freed slot (each try is a decide call)


@dataclass
class RunResult:
    strategy: Strategy
    requests: Requests
    ttft: list[float]
    tpot: list[float]
    path: list[int]  # 1 local prefill, 2 remote, 0 never prefilled
    cached: list[int]  # prompt tokens the prefill found in its prefix cache
    error: list[str | None]
    deferred: int
    retried_routes: int
    transfer_retries: int
    local_fallbacks: int
    kv_bytes_sent: float
    link_served: list[float]  # bytes per second, per 1-s bucket
    link_gbps: float
    end_time: float  # last completion or error (simulated seconds)
    decisions: int  # calls of decide (retries and deferred re-tries included)
    busy_s: dict[str, float]  # prefill seconds per pool, decode slot-seconds
    decode_max_batch: int


class ClusterSim:
    def __init__(self, spec: SimSpec, strategy: Strategy, requests: Requests) -> None:
        self.spec, self.strategy, self.req = spec, strategy, requests
        self.env = simpy.Environment()
        seed = spec.seed
        self.rng = random.Random(seed * 1_000_003 + 11)  # candidate sampling
        self.fail_rng = random.Random(seed * 1_000_003 + 29)  # transfer failures
        self.cfg = strategy.config
        self.routing = self.cfg.routing
        self.max_retry = self.cfg.kv_cache.max_retry
        n = len(requests)
        nan = math.nan
        self.ttft, self.tpot = [nan] * n, [nan] * n
        self.path, self.cached, self.error = [_NONE] * n, [0] * n, [None] * n
        self.pre_of, self.dec_of = [-1] * n, [-1] * n
        self.parts = [0] * n  # remote: prefill and transfer still running (0 = KV ready)
        self.kv_bytes = [0.0] * n
        self.send_tokens = [0] * n  # prompt tokens whose KV crosses (decode holds the rest)
        self.attempts = [0] * n
        self.route_tries = [0] * n
        self.fallbacks: list[tuple[str, ...]] = [()] * n
        self.transfer: list[Transfer | None] = [None] * n
        self.was_deferred = [False] * n
        self.outstanding = n
        self.deferred_q: deque[int] = deque()
        self.poll_pending = False
        self.counts = {"retried_routes": 0, "transfer_retries": 0, "local_fallbacks": 0, "decisions": 0}
        self.busy = {"remote_prefill": 0.0, "local_prefill": 0.0, "decode": 0.0}
        self.last_done = 0.0  # simulated time of the last completion or error
        self.kv_sent = 0.0
        self.kv_tokens_sent = 0.0
        self.in_flight = 0.0
        self._build_instances()

    # ------------------------------------------------------------------------------ layout
    def _build_instances(self) -> None:
        spec, st = self.spec, self.strategy
        self.prefill_index: HolderIndex = HolderIndex()
        self.decode_index: HolderIndex = HolderIndex()
        cap = self.cfg.prefill_pool.max_queue_depth
        self.prefills: list[PrefillInstance] = []
        remote_tps, local_tps = spec.prefill_tokens_per_s(True), spec.prefill_tokens_per_s(False)
        for i in range(st.remote_instances):
            self.prefills.append(PrefillInstance(len(self.prefills), f"{REMOTE_DC}-prefill-{i}", REMOTE_DC, True,
                                                 spec.remote_time, remote_tps, cap, spec.prefill_cache_tokens,
                                                 self.prefill_index))
        for i in range(st.local_prefill):
            self.prefills.append(PrefillInstance(len(self.prefills), f"{LOCAL_DC}-prefill-{i}", LOCAL_DC, False,
                                                 spec.local_time, local_tps, cap, spec.prefill_cache_tokens,
                                                 self.prefill_index))
        self.remote = [p for p in self.prefills if p.remote]
        self.local = [p for p in self.prefills if not p.remote]
        self.decodes = [DecodeInstance(i, f"{LOCAL_DC}-decode-{i}", spec.decode_capacity, spec.decode.max_batch,
                                       spec.decode_cache_tokens, self.decode_index) for i in range(st.decode)]
        self.by_name: dict[str, PrefillInstance] = {p.name: p for p in self.prefills}
        self.decode_by_name = {d.name: d for d in self.decodes}
        self.link = SharedLink(self.env, spec.link, self._on_transfer, random.Random(spec.seed * 7 + 3)) \
            if self.remote else None
        self.latency = spec.link.one_way_s
        mean = spec.setup.workload.mean()
        self.kv_bpt_init = spec.kv.wire_bytes(mean) / mean
        self.snap = SnapshotBuilder(
            self.req, self.local, self.remote, self.decodes, self.link, self.prefill_index, self.decode_index,
            CandidatePolicy(spec.candidates_k, spec.exact_below, st.cache_aware), self.rng, self._kv_bytes_per_token,
            lambda: self.in_flight, st.threshold_tokens, st.policy)
        self.tpot_table = spec.decode.tpot

    def _kv_bytes_per_token(self) -> float:
        """What the scheduler measures on transfers: wire bytes per prompt token sent so far."""
        if self.kv_tokens_sent <= 0:
            return self.kv_bpt_init
        return self.kv_sent / self.kv_tokens_sent

    # ------------------------------------------------------------------------------ run
    def run(self) -> RunResult:
        env = self.env
        env.process(self._arrivals())
        if self.link is not None:
            env.process(self.link.run_capacity(self._idle))
        if self.spec.failures.remote_crash_per_hour > 0:
            for inst in self.remote:
                env.process(self._crashes(inst))
        last = self.req.arrival[-1] if len(self.req) else 0.0
        env.run(until=last + self.spec.drain_s)
        for r in range(len(self.req)):
            if self.error[r] is None and math.isnan(self.tpot[r]):
                self.error[r] = "unfinished"
        c = self.counts
        return RunResult(self.strategy, self.req, self.ttft, self.tpot, self.path, self.cached, self.error,
                         sum(self.was_deferred), c["retried_routes"], c["transfer_retries"], c["local_fallbacks"],
                         self.kv_sent, self.link.served if self.link else [], self.spec.link.gbps, self.last_done,
                         c["decisions"], self.busy, self.spec.decode.max_batch)

    def _idle(self) -> bool:
        return self.outstanding == 0

    def _later(self, delay: float, fn: Callable[[Event], None], value: object) -> None:
        ev = Timeout(self.env, delay, value)
        ev.callbacks.append(fn)

    def _arrivals(self) -> Generator[Event, None, None]:
        env, arrival = self.env, self.req.arrival
        for r in range(len(arrival)):
            dt = arrival[r] - env.now
            if dt > 0:
                yield env.timeout(dt)
            self._route(r)

    # ------------------------------------------------------------------------------ routing
    def _decide(self, r: int) -> Route:
        self.counts["decisions"] += 1
        request, snap = self.snap.build(r)
        return decide(request, snap, self.cfg)

    def _route(self, r: int) -> None:
        try:
            route = self._decide(r)
        except Defer:
            self._defer(r)
            return
        except NoRoute as exc:
            self._refused(r, exc)
            return
        self._start(r, route)

    def _refused(self, r: int, exc: NoRoute) -> None:
        now = self.env.now
        if exc.status not in (429, 503):
            self._fail(r, exc.code)
            return
        self.route_tries[r] += 1
        delay = min(_MAX_BACKOFF_S, self.spec.retry_after_s * 2 ** (self.route_tries[r] - 1))
        if now + delay > self.req.arrival[r] + self.spec.retry_budget_s:
            self._fail(r, exc.code)
            return
        self.counts["retried_routes"] += 1
        self._later(delay, self._on_retry, r)

    def _on_retry(self, ev: Event) -> None:
        self._route(ev.value)

    def _defer(self, r: int) -> None:
        self.was_deferred[r] = True
        if len(self.deferred_q) >= self.routing.batch_queue_max:
            self._fail(r, "batch_queue_full")
            return
        self.deferred_q.append(r)
        self._poll_deferred()

    def _poll_deferred(self) -> None:
        if not self.poll_pending and self.deferred_q:
            self.poll_pending = True
            self._later(1.0, self._on_poll, None)

    def _on_poll(self, _ev: Event) -> None:
        self.poll_pending = False
        self._try_deferred()
        self._poll_deferred()

    def _try_deferred(self) -> None:
        q, now, wait = self.deferred_q, self.env.now, self.routing.batch_max_wait_s
        for _ in range(_BATCH_TRIES):
            if not q:
                return
            r = q[0]
            if now - self.req.arrival[r] > wait:
                q.popleft()
                self._fail(r, "batch_timeout")
                continue
            try:
                route = self._decide(r)
            except Defer:
                return  # head of line still waits: so does everything behind it
            except NoRoute as exc:
                q.popleft()
                self._refused(r, exc)
                continue
            q.popleft()
            self._start(r, route)

    def _start(self, r: int, route: Route) -> None:
        dec = self.decode_by_name[route.decode]
        dec.held += 1
        self.dec_of[r] = dec.idx
        pre = self.by_name[route.prefill]
        if route.kind == "remote":
            self.fallbacks[r] = route.fallbacks
            size = self.spec.kv.send_bytes(self.req.prompt[r], route.decode_held_tokens)
            self.kv_bytes[r] = size
            self.send_tokens[r] = self.req.prompt[r] - route.decode_held_tokens
            self.in_flight += size
        self._enqueue(pre, r)

    def _fail(self, r: int, code: str) -> None:
        self.error[r] = code
        self.outstanding -= 1
        self.last_done = self.env.now

    # ------------------------------------------------------------------------------ prefill
    def _enqueue(self, pre: PrefillInstance, r: int) -> None:
        self.pre_of[r] = pre.idx
        if pre.busy:
            pre.queue.append(r)
            return
        pre.busy = True
        pre.current = r
        # A remote prefill starts once the request has crossed the link (one way).
        self._later(self.latency if pre.remote else 0.0, self._on_begin, (pre.idx, r, pre.epoch))

    def _on_begin(self, ev: Event) -> None:
        idx, r, epoch = ev.value
        pre = self.prefills[idx]
        if pre.epoch == epoch:
            self._begin(pre, r)

    def _begin(self, pre: PrefillInstance, r: int) -> None:
        req = self.req
        prompt, key = req.prompt[r], req.key[r]
        cached = pre.cache.hit(key, req.prefix_len[r]) if key >= 0 else 0
        self.cached[r] = cached
        if pre.remote:
            self.parts[r] = 2
            self.attempts[r] = 0
            if not self._send(r):
                self._fallback_local(r)
                self._next(pre)
                return
        seconds = pre.time.uncached(prompt, cached)
        self.busy["remote_prefill" if pre.remote else "local_prefill"] += seconds
        self._later(seconds, self._on_prefilled, (pre.idx, r, pre.epoch))

    def _on_prefilled(self, ev: Event) -> None:
        idx, r, epoch = ev.value
        pre = self.prefills[idx]
        if pre.epoch != epoch:
            return  # the instance crashed meanwhile; its requests were handed on
        req = self.req
        if req.key[r] >= 0:
            pre.cache.put(req.key[r], req.put_prefill[r])
        self._next(pre)
        if self.pre_of[r] == idx and self.error[r] is None:  # not moved to a fallback meanwhile
            if pre.remote:
                self.parts[r] -= 1
                if self.parts[r] == 0:
                    self._later(self.latency, self._on_kv_ready, r)
            else:
                self.path[r] = _LOCAL
                self._kv_ready(r)
        if self.deferred_q:
            self._try_deferred()

    def _next(self, pre: PrefillInstance) -> None:
        if pre.queue:
            r = pre.queue.popleft()
            pre.current = r
            self._begin(pre, r)
        else:
            pre.busy = False
            pre.current = -1

    # ------------------------------------------------------------------------------ KV transfer
    def _send(self, r: int) -> bool:
        assert self.link is not None
        tr = self.link.start(r, self.kv_bytes[r])
        self.transfer[r] = tr
        return tr is not None

    def _on_transfer(self, tr: Transfer, ok: bool) -> None:
        r = tr.request
        if self.transfer[r] is not tr:
            return
        self.transfer[r] = None
        p = self.spec.failures.transfer_failure_prob
        if ok and p > 0 and self.fail_rng.random() < p:
            ok = False
        if ok:
            self.kv_sent += tr.bytes
            self.kv_tokens_sent += self.send_tokens[r]
            self.in_flight -= tr.bytes
            self.parts[r] -= 1
            if self.parts[r] == 0:
                self._later(self.latency, self._on_kv_ready, r)
            return
        self.attempts[r] += 1
        if self.attempts[r] <= self.max_retry and self.link is not None and self.link.up:
            self.counts["transfer_retries"] += 1
            if self._send(r):
                return
        self._fallback_local(r)

    def _fallback_local(self, r: int) -> None:
        """Repeated transfer failure: prefill again locally, or fail the request."""
        self.in_flight -= self.kv_bytes[r]
        self.kv_bytes[r] = 0.0
        if self.routing.fallback_to_local_on_failure:
            for name in self.fallbacks[r]:
                pre = self.by_name[name]
                if not pre.remote:
                    self.counts["local_fallbacks"] += 1
                    self._enqueue(pre, r)
                    return
        self._release_decode(r)
        self._fail(r, "kv_transfer_failed")

    # ------------------------------------------------------------------------------ failures
    def _crashes(self, inst: PrefillInstance) -> Generator[Event, None, None]:
        f = self.spec.failures
        rng = random.Random(self.spec.seed * 1_000_003 + 101 + inst.idx)  # same crashes for every strategy
        rate = f.remote_crash_per_hour / 3600.0
        while not self._idle():
            yield self.env.timeout(rng.expovariate(rate))
            if self._idle():
                return
            self._crash(inst)
            yield self.env.timeout(f.repair_s)
            inst.up = True

    def _crash(self, inst: PrefillInstance) -> None:
        inst.up = False
        inst.epoch += 1
        victims = ([inst.current] if inst.busy else []) + list(inst.queue)
        inst.queue.clear()
        inst.busy, inst.current = False, -1
        inst.cache.clear()
        for r in victims:
            tr = self.transfer[r]
            if tr is not None and self.link is not None:
                self.link.cancel(tr)
                self.transfer[r] = None
            self._failover(r, inst)

    def _failover(self, r: int, dead: PrefillInstance) -> None:
        for name in self.fallbacks[r]:
            pre = self.by_name[name]
            if pre is dead or not pre.up:
                continue
            if not pre.remote:
                self.in_flight -= self.kv_bytes[r]
                self.kv_bytes[r] = 0.0
                self.counts["local_fallbacks"] += 1
            self._enqueue(pre, r)
            return
        self.in_flight -= self.kv_bytes[r]
        self._release_decode(r)
        self._fail(r, "prefill_failed")

    # ------------------------------------------------------------------------------ decode
    def _on_kv_ready(self, ev: Event) -> None:
        r = ev.value
        self.path[r] = _REMOTE
        self._kv_ready(r)

    def _kv_ready(self, r: int) -> None:
        dec = self.decodes[self.dec_of[r]]
        if dec.active < dec.max_batch:
            self._admit(dec, r)
        else:
            dec.waiting.append(r)

    def _admit(self, dec: DecodeInstance, r: int) -> None:
        dec.active += 1
        step = self.tpot_table[dec.active]
        now = self.env.now
        self.ttft[r] = now + step - self.req.arrival[r]
        self.tpot[r] = step
        key = self.req.key[r]
        if key >= 0:
            dec.cache.hit(key, self.req.prefix_len[r])
        self.busy["decode"] += self.req.output[r] * step
        self._later(self.req.output[r] * step, self._on_finished, r)

    def _on_finished(self, ev: Event) -> None:
        r = ev.value
        dec = self.decodes[self.dec_of[r]]
        dec.active -= 1
        dec.held -= 1
        key = self.req.key[r]
        if key >= 0:
            dec.cache.put(key, self.req.put_decode[r])
        self.outstanding -= 1
        self.last_done = self.env.now
        while dec.waiting and dec.active < dec.max_batch:
            self._admit(dec, dec.waiting.popleft())
        if self.deferred_q:
            self._try_deferred()

    def _release_decode(self, r: int) -> None:
        if self.dec_of[r] >= 0:
            self.decodes[self.dec_of[r]].held -= 1
            self.dec_of[r] = -1
