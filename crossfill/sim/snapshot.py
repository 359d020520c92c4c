"""The snapshot `decide` sees for one request: a few candidates, not the whole cluster.

`decide` ranks every instance of its snapshot, so a 1,000-instance snapshot per request would
cost milliseconds; instead each decision gets power-of-k choices: `k` instances drawn at random
from each pool (remote prefill, local prefill, decode), preferring ones with room so a decision is
not refused while most of the pool is idle, plus up to two instances of each kind holding the
request's prefix (from the holder index), plus the link. Pools of at most `exact_below` instances
are given whole, so small clusters (and the tests) see exactly what the live scheduler would.

What the simulated scheduler knows is exact and current: queue depths are the instances' real
queues (the live one probes every 500 ms and counts `pending` in between; here `pending` is 0),
and the link's bandwidth is its true current capacity (a perfect monitor).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from crossfill.policy import InstanceState, LinkState, RouteRequest, Snapshot
from crossfill.policy.routing import PrefillPolicy
from crossfill.sim.cache import HolderIndex
from crossfill.sim.instances import DecodeInstance, PrefillInstance
from crossfill.sim.link import SharedLink
from crossfill.sim.workload import Requests

LOCAL_DC = "local"
REMOTE_DC = "remote"
_HOLDERS = 2  # prefix holders added per kind
T = TypeVar("T", PrefillInstance, DecodeInstance)


@dataclass
class CandidatePolicy:
    k: int = 4
    exact_below: int = 16
    cache_aware: bool = True  # pass cached_tokens (the scheduler's KV index) to decide


class SnapshotBuilder:
    def __init__(self, req: Requests, local: Sequence[PrefillInstance], remote: Sequence[PrefillInstance],
                 decodes: Sequence[DecodeInstance], link: SharedLink | None, prefill_index: HolderIndex,
                 decode_index: HolderIndex, candidates: CandidatePolicy, rng: random.Random,
                 kv_bytes_per_token: Callable[[], float], in_flight_bytes: Callable[[], float],
                 threshold_tokens: int | None, policy: PrefillPolicy) -> None:
        self.req, self.local, self.remote, self.decodes = req, local, remote, decodes
        self.link, self.prefill_index, self.decode_index = link, prefill_index, decode_index
        self.c, self.rng = candidates, rng
        self.kv_bytes_per_token, self.in_flight_bytes = kv_bytes_per_token, in_flight_bytes
        self.threshold, self.policy = threshold_tokens, policy

    def build(self, r: int) -> tuple[RouteRequest, Snapshot]:
        req = self.req
        seen: set[int] = set()
        prefills: list[PrefillInstance] = []
        decodes: list[DecodeInstance] = []
        self._sample(self.remote, prefills, seen, _prefill_room)
        self._sample(self.local, prefills, seen, _prefill_room)
        self._sample(self.decodes, decodes, seen, _decode_room)
        cached: dict[str, int] = {}
        key, limit = req.key[r], req.prefix_len[r]
        if self.c.cache_aware and key >= 0 and limit > 0:
            for inst in self.prefill_index.pick(key, _HOLDERS, self.rng):
                if id(inst) not in seen and inst.up:
                    seen.add(id(inst))
                    prefills.append(inst)
            for inst in self.decode_index.pick(key, _HOLDERS, self.rng):
                if id(inst) not in seen:
                    seen.add(id(inst))
                    decodes.append(inst)
            for inst in (*prefills, *decodes):
                held = inst.cache.peek(key)
                if held:
                    cached[inst.name] = held if held < limit else limit
        states = [InstanceState(p.name, "prefill", p.datacenter, p.up, True, p.depth, p.capacity, 0, p.tokens_per_s)
                  for p in prefills]
        states += [InstanceState(d.name, "decode", LOCAL_DC, True, True, d.held, d.capacity, 0, None) for d in decodes]
        links: tuple[LinkState, ...] = ()
        link = self.link
        if link is not None and self.remote:
            links = (LinkState(REMOTE_DC, link.bandwidth_gbps, link.spec.one_way_s * 1000, link.up, None, "closed", "",
                               link.spec.gbps, int(self.in_flight_bytes()), link.egress_bytes_per_s()),)
        snap = Snapshot(LOCAL_DC, tuple(states), links, self.kv_bytes_per_token(), self.threshold)
        request = RouteRequest(req.prompt[r], self.policy, req.tenant[r], req.rtype[r], cached)  # type: ignore[arg-type]
        return request, snap

    def _sample(self, pool: Sequence[T], out: list[T], seen: set[int], room: Callable[[T], bool]) -> None:
        n = len(pool)
        if n <= self.c.exact_below:
            for inst in pool:
                seen.add(id(inst))
                out.append(inst)
            return
        k = self.c.k
        rand = self.rng.random  # int(random() * n): a third of randrange's cost
        got = tries = 0
        while got < k and tries < 4 * k:
            inst = pool[int(rand() * n)]
            tries += 1
            if id(inst) in seen or (tries <= 3 * k and not room(inst)):
                continue
            seen.add(id(inst))
            out.append(inst)
            got += 1


def _prefill_room(inst: PrefillInstance) -> bool:
    return inst.up and inst.depth < inst.capacity


def _decode_room(inst: DecodeInstance) -> bool:
    return inst.held < inst.capacity
