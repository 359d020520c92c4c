"""Synthetic requests: seeded, within their bounds, with the prefix and session structure asked for."""

from __future__ import annotations

import numpy as np
import pytest

from crossfill.planner.workload import LogNormalWorkload
from crossfill.sim.workload import Arrival, Lengths, PrefixSharing, Sessions, WorkloadSpec, generate

BASE = WorkloadSpec(Arrival("poisson", 10.0), Lengths(dist=LogNormalWorkload.from_median(2000, 1.0, 100, 20000)),
                    Lengths(fixed=100))


def test_same_seed_same_requests() -> None:
    a, b, c = generate(BASE, 500, 7), generate(BASE, 500, 7), generate(BASE, 500, 8)
    assert a.arrival == b.arrival and a.prompt == b.prompt
    assert a.prompt != c.prompt


def test_lengths_respect_the_truncation_and_the_median() -> None:
    r = generate(BASE, 4000, 1)
    prompt = np.asarray(r.prompt)
    assert prompt.min() >= 100 and prompt.max() <= 20000
    assert np.median(prompt) == pytest.approx(2000, rel=0.1)
    assert all(b > a for a, b in zip(r.arrival, r.arrival[1:], strict=False))
    assert len(r) / r.arrival[-1] == pytest.approx(10.0, rel=0.1)


def test_bursty_arrivals_have_the_asked_cv() -> None:
    spec = WorkloadSpec(Arrival("gamma", 10.0, cv=3.0), BASE.lengths, BASE.output)
    gaps = np.diff(generate(spec, 20000, 1).arrival)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)


def test_shared_prefixes_and_sessions() -> None:
    spec = WorkloadSpec(BASE.arrival, BASE.lengths, BASE.output, PrefixSharing(0.5, 4, 512),
                        Sessions(0.2, 3, 5.0, 64))
    r = generate(spec, 3000, 2)
    shared = [i for i, k in enumerate(r.key) if 0 <= k < 4]
    assert 0.3 < len(shared) / len(r) < 0.5  # half of the non-session requests
    assert all(r.prefix_len[i] == min(512, r.prompt[i] - 1) for i in shared)
    turns: dict[int, list[int]] = {}
    for i, k in enumerate(r.key):
        if k >= 4:
            turns.setdefault(k, []).append(i)
    follow_ups = [ids for ids in turns.values() if len(ids) > 1]
    assert follow_ups
    for ids in follow_ups:
        for prev, cur in zip(ids, ids[1:], strict=False):
            assert r.prefix_len[cur] == r.prompt[prev] + r.output[prev]
            assert r.prompt[cur] == r.prefix_len[cur] + 64
