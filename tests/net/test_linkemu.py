"""The WAN link emulator shapes real TCP traffic on loopback and injects faults on demand."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from crossfill.net.linkemu import LinkEmulator
from crossfill.net.units import UnitError

from .conftest import ping, wait_for

pytestmark = pytest.mark.timeout(60)


async def _send(port: int, nbytes: int, close: bool = True) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    block = bytes(range(256)) * 4096  # 1 MiB
    sent = 0
    while sent < nbytes:
        n = min(len(block), nbytes - sent)
        writer.write(block[:n])
        await writer.drain()
        sent += n
    if close:
        writer.close()
        await writer.wait_closed()


# Shaping is measured in real time. The emulator never lets bytes through faster than the link
# (checked on every run); a loaded machine can only make a run slower, so a rate below the link's is
# checked on the best of a few runs: one run at the link's speed shows the emulator reaches it.
TRIES = 3


async def _rate(sink, port: int, connections: int, nbytes: int) -> float:
    """Bits/s seen by the sink for `connections` x `nbytes` sent at once through the emulator at `port`."""
    sink.received.clear()
    sink.first = sink.last = None
    await asyncio.gather(*(_send(port, nbytes) for _ in range(connections)))
    await wait_for(lambda: sink.total == connections * nbytes)
    return connections * nbytes * 8 / (sink.last - sink.first)


@pytest.mark.parametrize("mbit", [50, 200])
async def test_throughput_matches_configured_bandwidth(sink, mbit):
    nbytes = mbit * 1_000_000 // 8  # about one second of link time
    rates = []
    async with LinkEmulator(("127.0.0.1", sink.port), bandwidth=f"{mbit}mbit", latency="10ms") as emu:
        while len(rates) < TRIES and not (rates and max(rates) >= 0.85 * mbit * 1e6):
            rates.append(await _rate(sink, emu.listen_port, 1, nbytes))
            assert rates[-1] <= 1.15 * mbit * 1e6, rates
    assert max(rates) >= 0.85 * mbit * 1e6, rates
    assert emu.counters.up.bytes_out == nbytes * len(rates)


async def test_bandwidth_is_shared_by_connections_like_a_link(sink):
    nbytes = 1_500_000  # 3 MB total through 48 Mbit/s: ~0.5 s
    rates = []
    async with LinkEmulator(("127.0.0.1", sink.port), bandwidth="48mbit") as emu:
        while len(rates) < TRIES and not (rates and max(rates) >= 0.85 * 48e6):
            rates.append(await _rate(sink, emu.listen_port, 2, nbytes))
            assert rates[-1] <= 1.15 * 48e6, rates  # two connections share one link's rate
    assert max(rates) >= 0.85 * 48e6, rates


async def test_added_round_trip_is_twice_the_latency(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port), latency="30ms") as emu:
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        rtts = [await ping(reader, writer) for _ in range(7)]
        writer.close()
    assert min(rtts) >= 0.0599, rtts  # every round trip pays the latency both ways
    assert min(rtts) < 0.072, rtts  # and little more: the least of them, which load does not inflate


async def test_jitter_spreads_delay_around_latency(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port), latency="40ms", jitter="20ms", seed=7) as emu:
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        rtts = [await ping(reader, writer) for _ in range(12)]
        writer.close()
    assert max(rtts) - min(rtts) > 0.015  # two one-way delays, each uniform in 20..60 ms
    assert 0.035 < min(rtts)  # a floor: never below the least delay both ways
    # Above: at most 2 x 60 ms, and the mean near 80 ms; the room beyond is for a loaded machine,
    # well short of what jitter counted twice (up to 160 ms) would give.
    assert max(rtts) < 0.16, rtts
    assert 0.06 < statistics.mean(rtts) < 0.11, rtts


async def test_loss_costs_a_retransmission_delay_and_is_counted(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port), latency="5ms", loss="30%", seed=3) as emu:
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        rtts = [await ping(reader, writer) for _ in range(10)]
        writer.close()
    lost = emu.counters.up.lost_segments + emu.counters.down.lost_segments
    slow = [r for r in rtts if r >= 0.2]
    assert lost > 0 and slow, (lost, rtts)
    assert len(slow) <= lost  # each slow round trip is explained by a counted loss
    assert min(rtts) < 0.05  # round trips without loss pay only the latency


async def test_cut_after_bytes_delivers_n_bytes_then_closes_both_sides(sink):
    async with LinkEmulator(("127.0.0.1", sink.port)) as emu:
        emu.arm(cut_after_bytes=100_000)
        _, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        with pytest.raises((ConnectionError, OSError)):
            for _ in range(200):  # the client notices the cut on a later write
                writer.write(b"z" * 65536)
                await writer.drain()
                await asyncio.sleep(0.005)
        await wait_for(lambda: sink.closed and sink.closed[0])
        assert sink.total == 100_000
        assert emu.counters.cuts == 1
        # the link keeps working for new connections once the fault is used up
        await _send(emu.listen_port, 5000)
        await wait_for(lambda: len(sink.received) == 2 and len(sink.received[1]) == 5000)


async def test_corrupt_flips_exactly_the_next_k_bytes(sink):
    payload = bytes(range(256)) * 40
    async with LinkEmulator(("127.0.0.1", sink.port)) as emu:
        emu.arm(corrupt_bytes=3)
        _, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        writer.write(payload)
        await writer.drain()
        writer.close()
        await wait_for(lambda: sink.total == len(payload))
    got = bytes(sink.received[0])
    assert got[:3] == bytes(b ^ 0xFF for b in payload[:3])
    assert got[3:] == payload[3:]
    assert emu.counters.up.corrupted_bytes == 3


async def test_stall_holds_traffic_for_t_ms(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port), latency="2ms") as emu:
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        before = await ping(reader, writer)
        emu.arm(stall_ms=1000)
        during = await ping(reader, writer)
        after = await ping(reader, writer)
        writer.close()
    # Outside the stall a round trip is a few ms (room for a loaded machine, far below the stall).
    assert before < 0.25 and after < 0.25
    assert 0.98 <= during < 1.5  # the stall's length, not twice it
    assert emu.counters.stalls == 1


async def test_disarm_releases_what_a_long_stall_holds_at_once(echo_port):
    # A stall far longer than the test: only the disarm can let the held round trip through, and
    # the connection stays usable afterwards (nothing keeps the stall's departure time).
    async with LinkEmulator(("127.0.0.1", echo_port), latency="2ms") as emu:
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        await ping(reader, writer)
        sent = emu.counters.up.bytes_in
        emu.arm(stall_ms=600_000)
        held = asyncio.ensure_future(ping(reader, writer))
        await wait_for(lambda: emu.counters.up.bytes_in > sent)  # the emulator holds it now
        assert not held.done()
        emu.disarm()
        await asyncio.wait_for(held, 30)
        await asyncio.wait_for(ping(reader, writer), 30)
        writer.close()


async def test_bad_settings_name_the_field():
    with pytest.raises(UnitError, match="bandwidth '10 parsecs'"):
        LinkEmulator(("127.0.0.1", 9), bandwidth="10 parsecs")
    emu = LinkEmulator(("127.0.0.1", 9), latency="5ms")
    with pytest.raises(UnitError, match="loss"):
        emu.update(latency="50ms", loss="150%")
    assert emu.settings.latency_s == 0.005  # a refused update changes nothing
    with pytest.raises(UnitError, match="upstream"):
        LinkEmulator("no-port-here")


async def test_upstream_down_closes_the_client():
    async with LinkEmulator(("127.0.0.1", 1)) as emu:  # nothing listens on port 1
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        try:
            assert await asyncio.wait_for(reader.read(), 30) == b""
        except ConnectionError:
            pass
        writer.close()
        assert emu.counters.upstream_connect_errors == 1


async def test_control_endpoint_over_http(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port), latency="1ms", control="127.0.0.1:0") as emu:
        base = f"http://127.0.0.1:{emu.control_port}"
        async with httpx.AsyncClient(base_url=base, timeout=5, trust_env=False) as http:
            status = (await http.get("/link")).json()
            assert status["settings"]["latency_ms"] == pytest.approx(1.0)
            assert status["upstream"] == f"127.0.0.1:{echo_port}"

            reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
            fast = await ping(reader, writer)
            r = await http.post("/link", json={"latency": "40ms", "bandwidth": "100mbit", "loss": "0%"})
            assert r.status_code == 200 and r.json()["settings"]["bandwidth"] == "100mbit"
            slow = await ping(reader, writer)
            # 2 x 40 ms is a floor; before the change a round trip was far below it
            assert fast < 0.06 and 0.0799 <= slow < 0.2, (fast, slow)

            counters = (await http.get("/link")).json()["counters"]
            assert counters["up"]["bytes_out"] == 128 and counters["connections_open"] == 1

            t0 = time.perf_counter()
            r = await http.post("/faults", json={"stall_ms": 200})
            assert r.status_code == 200 and r.json()["faults"]["stall_remaining_ms"] > 100  # armed, then answered
            await ping(reader, writer)
            assert time.perf_counter() - t0 >= 0.2  # the ping waited for the stall armed after t0
            writer.close()

            for body, field in [
                ({"bandwidth": "fast"}, "bandwidth"),
                ({"latency": -3}, "latency"),
                ({"jitter": [1]}, "jitter"),
                ({"speed": 1}, "speed"),
            ]:
                r = await http.post("/link", json=body)
                assert r.status_code == 400 and r.json()["field"] == field, r.text
            for body, field in [
                ({"cut_after_bytes": -1}, "cut_after_bytes"),
                ({"corrupt_bytes": "many"}, "corrupt_bytes"),
                ({"stall_ms": 5, "direction": "sideways"}, "direction"),
                ({"explode": True}, "explode"),
            ]:
                r = await http.post("/faults", json=body)
                assert r.status_code == 400 and r.json()["field"] == field, r.text
            r = await http.post("/faults", json={})
            assert r.status_code == 400 and "at least one" in r.json()["error"]
            r = await http.post("/link", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert (await http.get("/link")).json()["settings"]["latency_ms"] == pytest.approx(40.0)
