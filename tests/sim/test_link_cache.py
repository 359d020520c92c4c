"""Processor sharing on the link, outages, and the LRU prefix caches with their holder index."""

from __future__ import annotations

import random

import pytest
import simpy

from crossfill.sim.cache import HolderIndex, PrefixCache
from crossfill.sim.link import LinkSpec, SharedLink, Transfer


def _link(spec: LinkSpec) -> tuple[simpy.Environment, SharedLink, list[tuple[int, bool, float]]]:
    env = simpy.Environment()
    done: list[tuple[int, bool, float]] = []
    link = SharedLink(env, spec, lambda tr, ok: done.append((tr.request, ok, env.now)), random.Random(0))
    return env, link, done


def test_two_transfers_share_the_bandwidth() -> None:
    env, link, done = _link(LinkSpec(gbps=8.0))  # 1 GB/s
    link.start(0, 1e9)
    link.start(1, 1e9)
    env.run()
    assert [(r, ok) for r, ok, _ in done] == [(0, True), (1, True)]
    assert [t for *_, t in done] == pytest.approx([2.0, 2.0])
    assert sum(link.served) == pytest.approx(2e9)


def test_a_short_transfer_overtakes_a_long_one() -> None:
    env, link, done = _link(LinkSpec(gbps=8.0))
    link.start(0, 3e9)
    env.run(until=1.0)
    link.start(1, 0.5e9)  # shares from t=1: needs 1 s at half rate
    env.run()
    assert done[0][:2] == (1, True) and done[0][2] == pytest.approx(2.0)
    assert done[1][:2] == (0, True) and done[1][2] == pytest.approx(3.5)


def test_an_outage_breaks_transfers_and_refuses_new_ones() -> None:
    env, link, done = _link(LinkSpec(gbps=8.0, outages=((1.0, 5.0),)))
    env.process(link.run_capacity(lambda: False))
    link.start(0, 4e9)
    env.run(until=2.0)
    assert done == [(0, False, 1.0)]
    assert not link.up and link.start(1, 1.0) is None
    env.run(until=7.0)
    assert link.up


def test_cancel_frees_the_share() -> None:
    env, link, done = _link(LinkSpec(gbps=8.0))
    tr = link.start(0, 4e9)
    link.start(1, 1e9)
    env.run(until=0.5)
    assert isinstance(tr, Transfer)
    link.cancel(tr)
    env.run()
    assert done == [(1, True, pytest.approx(1.25))]


class _Owner:
    pass


def test_lru_evicts_by_tokens_and_keeps_the_index() -> None:
    index: HolderIndex = HolderIndex()
    a, b = _Owner(), _Owner()
    ca, cb = PrefixCache(a, 100, index), PrefixCache(b, 100, index)
    ca.put(1, 60)
    cb.put(1, 60)
    assert {id(x) for x in index.pick(1, 5, random.Random(0))} == {id(a), id(b)}
    ca.put(2, 30)
    assert ca.hit(1, 1000) == 60  # refreshes key 1: key 2 is now the oldest
    ca.put(3, 30)
    assert ca.peek(2) == 0 and ca.peek(1) == 60 and ca.used == 90
    assert ca.hit(1, 10) == 10  # never more than the request's own prefix
    ca.clear()
    assert [id(x) for x in index.pick(1, 5, random.Random(0))] == [id(b)]
    assert index.pick(3, 5, random.Random(0)) == []
