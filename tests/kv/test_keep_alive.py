"""A sender that reports in before sending (a queued prefill) holds the wait for its manifest open;
once the manifest is in, only frames count, so a stalled link is still noticed."""

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


async def test_keep_alive_does_not_cover_a_silent_link_once_frames_flow(clock: Clock) -> None:
    table = TransferTable(timeout_s=1.0)
    a = table.expect(expectation("c2", Collector(), tenant="tenant-a"))
    a.accept_manifest(build_manifest(hybrid_specs(), 32, cache_id="c2"))
    clock.now += 0.9
    assert not table.keep_alive("c2")  # the sender is well, but its frames must come on the link
    clock.now += 0.2
    with pytest.raises(WireError):
        a.accept_manifest(build_manifest(hybrid_specs(), 32, cache_id="c2"))
    assert "no next frame or commit within 1000 ms" in str(a.done.exception())
    assert not table.keep_alive("unknown")
