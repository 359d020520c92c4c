"""The link monitor turns transfer and probe evidence into the snapshot the scheduler reads."""

from __future__ import annotations

import asyncio
import time

import pytest

from crossfill.config import NetworkConfig
from crossfill.net.link_monitor import LinkMonitor
from crossfill.net.linkemu import LinkEmulator
from crossfill.net.probe import LinkProber, start_echo_server

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unmeasured_link_is_trusted():
    snap = LinkMonitor().snapshot()
    assert snap.bandwidth_bps is None and snap.rtt_ms is None and snap.healthy and snap.up
    assert snap.reasons == ()


def test_bandwidth_ewma_follows_a_degrading_link():
    mon = LinkMonitor(min_bandwidth_gbps=40, alpha=0.5)
    mon.record_transfer(10_000_000_000, 1.0)  # 10 GB in 1 s = 80 Gbit/s
    assert mon.snapshot().bandwidth_gbps == pytest.approx(80)
    assert mon.snapshot().healthy
    for _ in range(4):
        mon.record_transfer(1_250_000_000, 1.0)  # 10 Gbit/s
    snap = mon.snapshot()
    assert 10 < snap.bandwidth_gbps < 15 and snap.samples == 5
    assert not snap.healthy and "min_bandwidth_gbps 40" in snap.reasons[0]


def test_small_transfers_do_not_count_as_bandwidth():
    mon = LinkMonitor(min_transfer_bytes=1 << 20)
    mon.record_transfer(1000, 0.02)  # latency-bound: 0.4 Mbit/s would be nonsense
    assert mon.snapshot().bandwidth_bps is None and mon.snapshot().samples == 0


def test_rtt_smoothing_min_and_latency_threshold():
    mon = LinkMonitor(max_latency_ms=10)
    for rtt in (0.010, 0.012, 0.011):
        mon.record_rtt(rtt)
    snap = mon.snapshot()
    assert snap.min_rtt_ms == pytest.approx(10) and 10 < snap.rtt_ms < 12
    assert snap.latency_ms == pytest.approx(snap.rtt_ms / 2) and snap.healthy
    for _ in range(30):
        mon.record_rtt(0.050)  # one-way 25 ms > 10 ms
    snap = mon.snapshot()
    assert snap.rtt_ms == pytest.approx(50, rel=0.1)
    assert not snap.healthy and "max_latency_ms 10" in snap.reasons[0]


def test_loss_retransmit_and_failures():
    mon = LinkMonitor(max_loss_rate=0.01, failures_to_down=3, alpha=1.0)
    mon.record_loss(1, 1000)
    mon.record_retransmit(5, 100)
    snap = mon.snapshot()
    assert snap.loss_rate == pytest.approx(0.001) and snap.retransmit_rate == pytest.approx(0.05)
    assert snap.healthy
    mon.record_loss(50, 1000)
    assert not mon.snapshot().healthy and "loss rate" in mon.snapshot().reasons[0]
    mon.record_loss(0, 1000)
    for _ in range(3):
        mon.record_failure()
    snap = mon.snapshot()
    assert not snap.up and not snap.healthy and "link down" in snap.reasons[0]
    mon.record_rtt(0.001)  # a success brings it back up
    assert mon.snapshot().up and mon.snapshot().healthy
    with pytest.raises(ValueError, match="record_loss"):
        mon.record_loss(5, 0)
    with pytest.raises(ValueError, match="record_transfer"):
        mon.record_transfer(10, 0)


def test_stale_estimates_are_dropped():
    clock = Clock()
    mon = LinkMonitor(min_bandwidth_gbps=40, stale_after_s=60, clock=clock)
    mon.record_transfer(1_250_000_000, 1.0)  # 10 Gbit/s: unhealthy
    assert not mon.snapshot().healthy
    clock.now += 61
    snap = mon.snapshot()
    assert snap.bandwidth_bps is None and snap.healthy and snap.age_s == pytest.approx(61)


def test_from_config_uses_the_seed_thresholds():
    mon = LinkMonitor.from_config(NetworkConfig(min_bandwidth_gbps=1, max_latency_ms=30))
    assert (mon.min_bandwidth_gbps, mon.max_latency_ms) == (1, 30)


async def test_real_measurement_through_the_emulator():
    """Bandwidth from a real transfer and RTT from real probes through a 100 Mbit/s, 20 ms link."""
    echo = await start_echo_server()
    received = 0
    done = asyncio.Event()
    nbytes = 2_500_000

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while data := await reader.read(1 << 20):
            received += len(data)
        writer.write(b"ack")  # the transfer counts as done when the receiver acknowledges it
        await writer.drain()
        writer.close()
        done.set()

    sink_server = await asyncio.start_server(sink, "127.0.0.1", 0)
    mon = LinkMonitor(min_bandwidth_gbps=1, max_latency_ms=10)
    try:
        async with (
            LinkEmulator(
                echo.sockets[0].getsockname()[:2], bandwidth="100mbit", latency="20ms"
            ) as probe_link,
            LinkEmulator(
                sink_server.sockets[0].getsockname()[:2], bandwidth="100mbit", latency="20ms"
            ) as data_link,
        ):
            prober = LinkProber(mon, "127.0.0.1", probe_link.listen_port, interval_s=0.05)
            await prober.start()
            reader, writer = await asyncio.open_connection("127.0.0.1", data_link.listen_port)
            t0 = time.perf_counter()
            writer.write(b"k" * nbytes)
            await writer.drain()
            writer.write_eof()
            assert await reader.read() == b"ack"
            mon.record_transfer(nbytes, time.perf_counter() - t0)
            writer.close()
            # Let the prober take samples until one came back at the link's own speed: a loaded
            # machine only makes round trips later, so the least of them is the link's.
            deadline = time.monotonic() + 30
            while not (mon.snapshot().rtt_samples >= 4 and mon.snapshot().min_rtt_ms <= 55):
                assert time.monotonic() < deadline, mon.snapshot()
                await asyncio.sleep(0.02)
            await prober.stop()
    finally:
        echo.close()
        sink_server.close()
    snap = mon.snapshot()
    assert received == nbytes
    # 2.5 MB at 100 Mbit/s is 0.2 s of link time (less the emulator's 10 ms burst credit) plus the
    # 20 ms latency and the ack's 20 ms back: never faster than that. A loaded machine makes it
    # slower, so the other bound only catches a unit slip (bits for bytes is 8x).
    assert nbytes * 8 / 0.8 <= snap.bandwidth_bps <= nbytes * 8 / 0.225, snap
    # the emulator adds 2 x 20 ms (a floor); the smoothed RTT may carry a late probe or two
    assert snap.rtt_samples >= 4, snap
    assert 39 <= snap.min_rtt_ms <= 55 and 39 <= snap.rtt_ms <= 200, snap
    assert snap.latency_ms == pytest.approx(snap.rtt_ms / 2)
    assert not snap.healthy  # 0.1 Gbit/s < 1 and 20 ms one-way > 10 ms
    assert len(snap.reasons) == 2


async def test_prober_marks_an_unreachable_link_down():
    mon = LinkMonitor(failures_to_down=2)
    async with LinkEmulator(("127.0.0.1", 1)) as emu:  # the far side refuses every connection
        prober = LinkProber(mon, "127.0.0.1", emu.listen_port, timeout_s=1)
        assert await prober.probe_once() is None
        assert await prober.probe_once() is None
        await prober.stop()
    assert not mon.snapshot().up
