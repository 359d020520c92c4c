"""A sender that reports in while it computes (a queued or slow prefill) holds decode's wait for
its KV open; once it stops reporting, the silence bound applies again."""

from __future__ import annotations

import pytest

from crossfill.kv import assembler
from crossfill.kv.assembler import TransferTable
from crossfill.kv.wire import WireError

from .helpers import Collector, build_manifest, expectation, hybrid_specs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(assembler.time, "monotonic", c)
    return c


async def test_keep_alive_restarts_the_wait_for_the_manifest(clock: Clock) -> None:
    table = TransferTable(timeout_s=1.0)
    a = table.expect(expectation("c1", Collector(), tenant="tenant-a"))
    for _ in range(5):  # five seconds of a queued prefill that reports in every 0.9 s
        clock.now += 0.9
        assert table.keep_alive("c1")
        a.check_time()
    assert not a.finished
    clock.now += 1.0  # then silence: the wait ends with a timeout naming what was missing
    a.check_time()
    assert a.finished and "no manifest within 1000 ms" in str(a.done.exception())


async def test_keep_alive_covers_a_slow_sender_between_frames_then_silence_counts(clock: Clock) -> None:
    # Decode forwards prefill's heartbeats only until its first token: after that everything is on
    # the wire, so the silence bound alone judges the link.
    table = TransferTable(timeout_s=1.0)
    a = table.expect(expectation("c2", Collector(), tenant="tenant-a"))
    m = build_manifest(hybrid_specs(), 32, cache_id="c2")
    a.accept_manifest(m)
    for _ in range(3):  # a prefill busy for 2.7 s between two layers, reporting in
        clock.now += 0.9
        assert table.keep_alive("c2")
    a.accept_manifest(m)  # still open: a reconnecting sender's manifest is accepted again
    clock.now += 1.1  # heartbeats stop (first token out), no frame comes
    with pytest.raises(WireError):
        a.accept_manifest(m)
    assert "no next frame or commit within 1000 ms" in str(a.done.exception())
    assert not table.keep_alive("c2") and not table.keep_alive("unknown")
