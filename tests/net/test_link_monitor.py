"""The link monitor turns probe and transfer evidence into the snapshot the scheduler routes on.

Every test of the estimator drives time with a fake clock: the windows and the breaker's cooldown
are checked at exact instants, with no sleeps and no wall-clock margins. Only the prober tests use
real sockets, and they assert what was recorded, never how long it took.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from crossfill.config import NetworkConfig
from crossfill.net.link_monitor import LinkMonitor, LinkSnapshot
from crossfill.net.linkemu import LinkEmulator
from crossfill.net.probe import LinkProber, measure_bandwidth, measure_bandwidth_paired, start_echo_server

from .conftest import wait_for

pytestmark = pytest.mark.timeout(60)

MB = 1_000_000


class Clock:
    """A clock that only moves when a test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def monitor(clock: Clock | None = None, **kw: Any) -> LinkMonitor:
    """A 5 ms RTT / 40 Gbit/s link's monitor with the defaults spelled out where tests rely on them."""
    args: dict[str, Any] = {
        "min_bandwidth_gbps": 40.0,
        "max_latency_ms": 10.0,
        "rtt_window": 10,
        "bandwidth_window_s": 5.0,
        "unhealthy_after": 3,
        "healthy_after": 2,
        "clock": clock or Clock(),
    }
    args.update(kw)
    return LinkMonitor(**args)


def gbit(gbps: float, seconds: float = 0.1) -> tuple[int, float]:
    """(nbytes, seconds) of a sample at `gbps`."""
    return int(gbps * 1e9 / 8 * seconds), seconds


# ---------------------------------------------------------------------------- a fresh link


def test_unmeasured_link_is_trusted_and_usable() -> None:
    snap = monitor(configured_bandwidth_gbps=100).snapshot()
    assert snap.rtt_ms is None and snap.latency_ms is None and snap.bandwidth_gbps is None
    assert snap.configured_bandwidth_gbps == 100
    assert snap.up and snap.healthy and snap.breaker == "closed" and snap.usable
    assert snap.reasons == () and snap.loss_rate == 0 and snap.retransmit_rate == 0
    assert (snap.rtt_samples, snap.bandwidth_samples, snap.transfers_ok, snap.transfers_failed) == (0, 0, 0, 0)


def test_as_dict_is_json_friendly_and_has_the_derived_fields() -> None:
    mon = monitor()
    mon.record_rtt(0.005)
    mon.record_bandwidth(*gbit(80))
    d = mon.snapshot().as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["rtt_ms"] == pytest.approx(5) and d["latency_ms"] == pytest.approx(2.5)
    assert d["bandwidth_gbps"] == pytest.approx(80) and d["usable"] is True
    assert d["breaker"] == "closed" and d["reasons"] == []
    assert set(d) >= {f for f in LinkSnapshot.__dataclass_fields__}


def test_from_config_uses_the_seed_thresholds() -> None:
    clock = Clock()
    mon = LinkMonitor.from_config(
        NetworkConfig(min_bandwidth_gbps=1, max_latency_ms=30), configured_bandwidth_gbps=25, rtt_window=3,
        clock=clock,
    )
    assert (mon.min_bandwidth_gbps, mon.max_latency_ms) == (1, 30)
    assert mon.snapshot().configured_bandwidth_gbps == 25
    for _ in range(3):
        mon.record_rtt(0.050)  # 25 ms one way <= 30
    assert mon.snapshot().healthy
    mon.set_configured_bandwidth(10)
    assert mon.snapshot().configured_bandwidth_gbps == 10


# ---------------------------------------------------------------------------- RTT: min filter


def test_one_slow_probe_changes_nothing() -> None:
    """The CI failure: one 50.8 ms probe on a 5 ms link (a late event loop) flipped it unhealthy."""
    mon = monitor()
    for _ in range(5):
        mon.record_rtt(0.005)
    mon.record_rtt(0.0508)  # 25.4 ms one way > max_latency_ms 10, if it were believed
    for _ in range(5):
        mon.record_rtt(0.005)
        snap = mon.snapshot()
        assert snap.rtt_ms == pytest.approx(5) and snap.healthy and snap.usable, snap
    # even a few slow probes in a row: the window still holds a fast one
    for _ in range(9):
        mon.record_rtt(0.0508)
    snap = mon.snapshot()
    assert snap.rtt_ms == pytest.approx(5) and snap.healthy and snap.rtt_samples == 20


def test_sustained_latency_rise_needs_the_window_then_hysteresis_and_recovery_needs_healthy_after() -> None:
    mon = monitor(rtt_window=10, unhealthy_after=3, healthy_after=2)
    for _ in range(10):
        mon.record_rtt(0.005)
    # The link really slows to 50 ms RTT. The min holds 5 ms until all 10 samples in the window are
    # slow (slow sample #10 is the first bad evaluation); #12 is the third bad one in a row.
    for i in range(1, 13):
        mon.record_rtt(0.050)
        snap = mon.snapshot()
        assert snap.rtt_ms == pytest.approx(50 if i >= 10 else 5), i
        assert snap.healthy == (i < 12), (i, snap)
    assert not snap.usable and snap.up and snap.breaker == "closed"
    assert len(snap.reasons) == 1 and "max_latency_ms 10" in snap.reasons[0] and "25 ms" in snap.reasons[0]
    # It recovers: the first fast probe brings the min down at once, and healthy_after=2 good
    # evaluations in a row bring the verdict back.
    mon.record_rtt(0.005)
    snap = mon.snapshot()
    assert snap.rtt_ms == pytest.approx(5) and not snap.healthy
    assert any("recovering: 1 of healthy_after 2" in r for r in snap.reasons), snap.reasons
    mon.record_rtt(0.005)
    snap = mon.snapshot()
    assert snap.healthy and snap.usable and snap.reasons == ()


def test_a_bad_streak_broken_by_a_good_evaluation_starts_over() -> None:
    mon = monitor(rtt_window=1, unhealthy_after=3)
    for rtt in (0.050, 0.050, 0.005, 0.050, 0.050):  # never 3 bad in a row
        mon.record_rtt(rtt)
        assert mon.snapshot().healthy
    mon.record_rtt(0.050)
    assert not mon.snapshot().healthy


def test_probe_outcomes_are_not_health_evaluations() -> None:
    """A prober reports an RTT and an outcome per probe; only the RTT is evidence about health."""
    mon = monitor(rtt_window=1, unhealthy_after=3)
    for _ in range(2):
        mon.record_rtt(0.050)
        mon.record_probe(True)
        mon.record_probe(True)
    assert mon.snapshot().healthy
    mon.record_rtt(0.050)
    assert not mon.snapshot().healthy


# ---------------------------------------------------------------------------- bandwidth: max filter


def test_slow_samples_on_a_fast_link_are_ignored_while_a_fast_one_is_in_the_window() -> None:
    clock = Clock()
    mon = monitor(clock, min_bandwidth_gbps=40, bandwidth_window_s=5)
    mon.record_bandwidth(*gbit(100))
    for _ in range(10):
        clock.advance(0.4)
        mon.record_bandwidth(*gbit(5))  # a busy machine read slowly
        snap = mon.snapshot()
        assert snap.bandwidth_gbps == pytest.approx(100) and snap.healthy
    assert snap.bandwidth_samples == 11


def test_slowed_link_is_seen_once_fast_samples_age_out_then_hysteresis() -> None:
    clock = Clock()
    mon = monitor(clock, min_bandwidth_gbps=40, bandwidth_window_s=5, unhealthy_after=3)
    mon.record_bandwidth(*gbit(100))  # at t0
    # the link really slows to 10 Gbit/s; one sample a second
    for t in range(1, 6):
        clock.advance(1)
        mon.record_bandwidth(*gbit(10))
        assert mon.snapshot().bandwidth_gbps == pytest.approx(100), t  # t0's sample is <= 5 s old
    clock.advance(0.5)  # t0 + 5.5: the fast sample has aged out, without any new sample
    snap = mon.snapshot()
    assert snap.bandwidth_gbps == pytest.approx(10)
    assert snap.healthy  # health moves on evaluations (samples), not on reads
    for i in range(1, 4):
        clock.advance(0.5)
        mon.record_bandwidth(*gbit(10))
        assert mon.snapshot().healthy == (i < 3), i
    snap = mon.snapshot()
    assert not snap.usable and "min_bandwidth_gbps 40" in snap.reasons[0] and "10 Gbit/s" in snap.reasons[0]


def test_speed_up_is_seen_at_the_first_fast_sample() -> None:
    clock = Clock()
    mon = monitor(clock, min_bandwidth_gbps=40, unhealthy_after=1, healthy_after=1)
    mon.record_bandwidth(*gbit(10))
    assert not mon.snapshot().healthy
    clock.advance(1)
    mon.record_bandwidth(*gbit(90))
    snap = mon.snapshot()
    assert snap.bandwidth_gbps == pytest.approx(90) and snap.healthy


def test_the_max_filter_keeps_the_largest_sample_of_the_window_across_expiries() -> None:
    """Samples 100, 60, 80, 30 one second apart: the max steps down 100 -> 80 -> 30 as they age out."""
    clock = Clock()
    mon = monitor(clock, bandwidth_window_s=5)
    for g in (100, 60, 80, 30):
        mon.record_bandwidth(*gbit(g))
        clock.advance(1)
    # now = t0 + 4
    assert mon.snapshot().bandwidth_gbps == pytest.approx(100)
    clock.advance(1.5)  # t0 + 5.5: 100 (t0) gone; 60 (t0+1) and 80 (t0+2) remain
    assert mon.snapshot().bandwidth_gbps == pytest.approx(80)
    clock.advance(2)  # t0 + 7.5: 80 (t0+2) gone, 30 (t0+3) remains
    assert mon.snapshot().bandwidth_gbps == pytest.approx(30)
    clock.advance(1)  # t0 + 8.5: nothing left: unmeasured, not a stale number
    assert mon.snapshot().bandwidth_gbps is None and mon.snapshot().bandwidth_samples == 4


def test_small_samples_do_not_count_as_bandwidth() -> None:
    mon = monitor(min_sample_bytes=64 * 1024, unhealthy_after=1)
    mon.record_bandwidth(1000, 0.02)  # latency-bound: 0.4 Mbit/s would be nonsense
    snap = mon.snapshot()
    assert snap.bandwidth_gbps is None and snap.bandwidth_samples == 0 and snap.healthy
    mon.record_bandwidth(64 * 1024, 1.0)  # at the limit: counted (and slow)
    assert mon.snapshot().bandwidth_samples == 1 and not mon.snapshot().healthy


# ---------------------------------------------------------------------------- loss, up / down


def test_loss_above_max_makes_unhealthy_with_hysteresis_and_ages_out() -> None:
    mon = monitor(max_loss_rate=0.05, stats_window=4, unhealthy_after=2, healthy_after=2)
    mon.record_transfer(True, frames=100, lost=1, retransmitted=3)
    snap = mon.snapshot()
    assert snap.loss_rate == pytest.approx(0.01) and snap.retransmit_rate == pytest.approx(0.03)
    assert snap.healthy and snap.transfers_ok == 1
    mon.record_transfer(True, frames=100, lost=29)  # 30 / 200 = 0.15 > 0.05: bad #1
    assert mon.snapshot().loss_rate == pytest.approx(0.15) and mon.snapshot().healthy
    mon.record_transfer(True, frames=100, lost=0)  # 30 / 300 = 0.1: bad #2
    snap = mon.snapshot()
    assert not snap.healthy and "max_loss_rate 0.05" in snap.reasons[0]
    mon.record_transfer(True, frames=100)  # 30 / 400 = 0.075: still bad
    mon.record_transfer(True, frames=100)  # window 4: the 1-lost transfer left; 29 / 400 still bad
    assert not mon.snapshot().healthy
    mon.record_transfer(True)  # no counts, but it takes a slot: the 29-lost transfer leaves
    snap = mon.snapshot()
    assert snap.loss_rate == 0 and not snap.healthy  # good #1 of healthy_after 2
    mon.record_transfer(True)
    assert mon.snapshot().healthy and mon.snapshot().transfers_ok == 7


def test_failures_mark_the_link_down_until_the_next_success() -> None:
    mon = monitor(failures_to_down=3, breaker_failures=10)
    mon.record_probe(False)
    mon.record_transfer(False)
    assert mon.snapshot().up
    mon.record_probe(False)
    snap = mon.snapshot()
    assert not snap.up and not snap.usable and snap.healthy  # down is not a health verdict
    assert "link down: 3" in snap.reasons[0] and "failures_to_down 3" in snap.reasons[0]
    mon.record_probe(True)
    assert mon.snapshot().up and mon.snapshot().usable
    for _ in range(3):
        mon.record_transfer(False)
    assert not mon.snapshot().up
    mon.record_transfer(True)
    assert mon.snapshot().up


def test_record_rtt_alone_does_not_bring_a_link_up() -> None:
    """A measurement is not an outcome; the prober reports both (see LinkProber)."""
    mon = monitor(failures_to_down=1)
    mon.record_probe(False)
    mon.record_rtt(0.005)
    assert not mon.snapshot().up


# ---------------------------------------------------------------------------- circuit breaker


def _open(mon: LinkMonitor, n: int = 3) -> None:
    for _ in range(n):
        mon.record_transfer(False)


def test_breaker_opens_after_consecutive_failed_transfers_only() -> None:
    mon = monitor(breaker_failures=3)
    mon.record_transfer(False)
    mon.record_transfer(False)
    mon.record_transfer(True)  # a success while closed resets the count
    mon.record_transfer(False)
    mon.record_transfer(False)
    for _ in range(5):
        mon.record_probe(False)  # probes do not open the breaker
    assert mon.snapshot().breaker == "closed"
    mon.record_transfer(False)
    snap = mon.snapshot()
    assert snap.breaker == "open" and not snap.usable and snap.transfers_failed == 5
    assert any("circuit breaker open" in r and "breaker_failures 3" in r for r in snap.reasons)


def test_breaker_open_then_half_open_after_cooldown_then_closed_by_probes() -> None:
    clock = Clock()
    mon = monitor(clock, breaker_failures=3, breaker_cooldown_s=10, half_open_successes=2)
    _open(mon)
    clock.advance(9.999)
    mon.record_probe(True)  # successes while open do not count toward closing
    mon.record_transfer(True)  # nor does an in-flight transfer finishing
    assert mon.snapshot().breaker == "open"
    mon.record_transfer(False)  # nor does an in-flight failure restart the cooldown
    clock.advance(0.001)
    snap = mon.snapshot()
    assert snap.breaker == "half_open" and not snap.usable
    assert any("0 of half_open_successes 2" in r for r in snap.reasons)
    mon.record_probe(True)
    assert mon.snapshot().breaker == "half_open"
    mon.record_probe(True)
    snap = mon.snapshot()
    assert snap.breaker == "closed" and snap.usable and snap.reasons == ()
    # closed again with a fresh count: it takes breaker_failures new failures to reopen
    mon.record_transfer(False)
    mon.record_transfer(False)
    assert mon.snapshot().breaker == "closed"


def test_a_successful_transfer_in_half_open_closes_the_breaker() -> None:
    clock = Clock()
    mon = monitor(clock, breaker_cooldown_s=10)
    _open(mon)
    clock.advance(10)
    mon.record_transfer(True)
    assert mon.snapshot().breaker == "closed"


@pytest.mark.parametrize("fail", [lambda m: m.record_probe(False), lambda m: m.record_transfer(False)])
def test_a_failure_in_half_open_reopens_for_a_new_cooldown(fail: Callable[[LinkMonitor], None]) -> None:
    clock = Clock()
    mon = monitor(clock, breaker_cooldown_s=10, half_open_successes=2)
    _open(mon)
    clock.advance(12)
    mon.record_probe(True)  # one of two
    assert mon.snapshot().breaker == "half_open"
    fail(mon)
    assert mon.snapshot().breaker == "open"
    clock.advance(9.5)  # the new cooldown runs from the failure, not from the first opening
    assert mon.snapshot().breaker == "open"
    clock.advance(0.5)
    assert mon.snapshot().breaker == "half_open"
    mon.record_probe(True)  # the earlier half-open success does not carry over
    assert mon.snapshot().breaker == "half_open"
    mon.record_probe(True)
    assert mon.snapshot().breaker == "closed"


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("min_bandwidth_gbps", -1.0),
        ("min_bandwidth_gbps", float("nan")),
        ("max_latency_ms", 0.0),
        ("max_latency_ms", -5.0),
        ("configured_bandwidth_gbps", 0.0),
        ("configured_bandwidth_gbps", float("inf")),
        ("max_loss_rate", 1.5),
        ("max_loss_rate", -0.1),
        ("rtt_window", 0),
        ("rtt_window", 2.5),
        ("bandwidth_window_s", 0.0),
        ("stats_window", 0),
        ("unhealthy_after", 0),
        ("healthy_after", 0),
        ("failures_to_down", 0),
        ("breaker_failures", 0),
        ("breaker_cooldown_s", -1.0),
        ("half_open_successes", 0),
        ("half_open_successes", True),
        ("min_sample_bytes", -1),
        ("clock", 3.0),
    ],
)
def test_bad_constructor_values_raise_naming_the_argument(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        monitor(**{name: value})


def test_bad_samples_raise_naming_the_method() -> None:
    mon = monitor()
    with pytest.raises(ValueError, match="record_rtt: seconds"):
        mon.record_rtt(-0.001)
    with pytest.raises(ValueError, match="record_bandwidth: seconds"):
        mon.record_bandwidth(1 << 20, 0)
    with pytest.raises(ValueError, match="record_bandwidth: nbytes"):
        mon.record_bandwidth(-1, 1.0)
    with pytest.raises(ValueError, match="record_transfer: lost must be <= frames"):
        mon.record_transfer(True, frames=1, lost=2)
    with pytest.raises(ValueError, match="record_transfer: retransmitted"):
        mon.record_transfer(True, frames=1, retransmitted=-1)
    with pytest.raises(ValueError, match="configured_bandwidth_gbps"):
        mon.set_configured_bandwidth(-3)
    snap = mon.snapshot()
    assert (snap.rtt_samples, snap.bandwidth_samples, snap.transfers_ok) == (0, 0, 0)


def test_concurrent_recording_loses_no_sample() -> None:
    mon = monitor(breaker_failures=10**9, failures_to_down=10**9)
    n = 1000

    def work() -> None:
        for i in range(n):
            mon.record_rtt(0.005)
            mon.record_bandwidth(*gbit(50))
            mon.record_transfer(i % 2 == 0, frames=10)
            mon.snapshot()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = mon.snapshot()
    assert (snap.rtt_samples, snap.bandwidth_samples) == (4 * n, 4 * n)
    assert (snap.transfers_ok, snap.transfers_failed) == (2 * n, 2 * n)


# ---------------------------------------------------------------------------- probe.py


async def test_prober_records_rtts_and_outcomes_from_a_real_echo_server() -> None:
    echo = await start_echo_server()
    mon = monitor(failures_to_down=1)
    mon.record_probe(False)  # down until a probe answers
    try:
        prober = LinkProber(mon, "127.0.0.1", echo.sockets[0].getsockname()[1], interval_s=0.01)
        rtt = await prober.probe_once()
        assert rtt is not None and rtt > 0
        snap = mon.snapshot()
        assert snap.rtt_samples == 1 and snap.up and snap.rtt_ms == pytest.approx(rtt * 1e3)
        await prober.start()  # the periodic loop keeps adding samples over the same connection
        await wait_for(lambda: mon.snapshot().rtt_samples >= 4)
        await prober.stop()
    finally:
        echo.close()
    snap = mon.snapshot()
    assert snap.up and snap.rtt_ms is not None and snap.rtt_ms > 0


async def test_prober_marks_an_unreachable_link_down_and_keeps_the_breaker_open() -> None:
    clock = Clock()
    mon = monitor(clock, failures_to_down=2, breaker_cooldown_s=10)
    _open(mon)
    clock.advance(10)
    assert mon.snapshot().breaker == "half_open"
    async with LinkEmulator(("127.0.0.1", 1)) as emu:  # the far side refuses every connection
        prober = LinkProber(mon, "127.0.0.1", emu.listen_port, timeout_s=5)
        assert await prober.probe_once() is None
        assert await prober.probe_once() is None
        await prober.stop()
    snap = mon.snapshot()
    assert not snap.up and snap.breaker == "open" and snap.rtt_samples == 0


async def test_measure_bandwidth_times_the_whole_fetch_less_one_rtt() -> None:
    clock = Clock()
    mon = monitor(clock)

    def fetch_taking(seconds: float, nbytes: int) -> Callable[[], Any]:
        async def fetch() -> int:
            clock.advance(seconds)
            return nbytes

        return fetch

    # no RTT known: the whole fetch is wire time (a lower bound)
    gbps = await measure_bandwidth(fetch_taking(0.1, 500 * MB), mon, clock=clock)
    assert gbps == pytest.approx(40) and mon.snapshot().bandwidth_gbps == pytest.approx(40)
    # 20 ms RTT known: 0.12 s of fetch is 0.1 s on the wire
    mon.record_rtt(0.020)
    gbps = await measure_bandwidth(fetch_taking(0.12, 625 * MB), mon, clock=clock)
    assert gbps == pytest.approx(50) and mon.snapshot().bandwidth_gbps == pytest.approx(50)
    # never more than 90 % of the fetch is subtracted (a stale RTT must not make a huge sample)
    gbps = await measure_bandwidth(fetch_taking(0.021, 1 * MB), mon, clock=clock)
    assert gbps == pytest.approx(1 * MB * 8 / 0.0021 / 1e9)
    # nothing received: nothing recorded
    assert await measure_bandwidth(fetch_taking(0.1, 0), mon, clock=clock) is None
    assert mon.snapshot().bandwidth_samples == 3

    async def failing() -> int:
        raise OSError("refused")

    with pytest.raises(OSError):
        await measure_bandwidth(failing, mon, clock=clock)
    assert mon.snapshot().bandwidth_samples == 3 and mon.snapshot().up


def test_one_low_bandwidth_sample_is_not_judged_again_at_every_rtt_probe() -> None:
    """A low sample taken while the far side was busy starting must not flip health by itself."""
    mon = LinkMonitor(min_bandwidth_gbps=0.5, max_latency_ms=50, unhealthy_after=3, clock=lambda: 0.0)
    mon.record_bandwidth(2 << 20, 0.12)  # 0.14 Gbit/s
    for _ in range(20):
        mon.record_rtt(0.010)
    assert mon.snapshot().healthy
    mon.record_bandwidth(2 << 20, 0.12)
    mon.record_bandwidth(2 << 20, 0.12)
    snap = mon.snapshot()
    assert not snap.healthy and any("min_bandwidth_gbps" in r for r in snap.reasons)


async def test_paired_bandwidth_probe_subtracts_the_round_trip_measured_now() -> None:
    """Right after latency rose, the monitor's windowed-min RTT is stale: the paired probe is not."""
    clock = Clock()
    mon = monitor(clock)
    mon.record_rtt(0.010)  # the old, low round trip still in the window

    async def fetch(n: int) -> int:  # 160 ms round trip now, 1 Gbit/s on the wire
        clock.advance(0.160 + n * 8 / 1e9)
        return n

    gbps = await measure_bandwidth_paired(fetch, mon, 2 * MB, clock=clock)
    assert gbps == pytest.approx(1.0, rel=1e-6)
    assert mon.snapshot().bandwidth_gbps == pytest.approx(1.0, rel=1e-6)
