"""The link emulator's capture records exactly what crossed, both directions, per connection."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from crossfill.net.capture import decode_streams
from crossfill.net.linkemu import LinkEmulator

pytestmark = pytest.mark.timeout(60)


async def _exchange(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    echoed = await reader.readexactly(len(payload))
    writer.close()
    await writer.wait_closed()
    return echoed


async def test_capture_records_both_directions_of_each_connection(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port)) as emu:
        await _exchange(emu.listen_port, b"before the capture")
        emu.start_capture()
        await _exchange(emu.listen_port, b"first secret")
        await _exchange(emu.listen_port, b"second secret")
        capture = emu.stop_capture()
        await _exchange(emu.listen_port, b"after the capture")
    assert capture is not None and not capture.truncated
    assert {(d, bytes(b)) for (_, d), b in capture.streams.items()} == {
        ("up", b"first secret"), ("down", b"first secret"), ("up", b"second secret"), ("down", b"second secret")}
    assert len({conn for conn, _ in capture.streams}) == 2
    assert capture.captured_bytes == 2 * len(b"first secret") + 2 * len(b"second secret")


async def test_capture_stops_at_its_budget(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port)) as emu:
        capture = emu.start_capture(max_bytes=10)
        await _exchange(emu.listen_port, b"0123456789abcdef")
    assert capture.truncated and capture.captured_bytes == 10


async def test_capture_over_the_control_api(echo_port):
    async with LinkEmulator(("127.0.0.1", echo_port), control="127.0.0.1:0") as emu:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{emu.control_port}", timeout=5,
                                     trust_env=False) as http:
            assert (await http.get("/capture")).status_code == 404  # none armed
            bad = await http.post("/capture", json={"max_bytes": 0})
            assert bad.status_code == 400 and bad.json()["field"] == "max_bytes"
            assert (await http.post("/capture", json={})).json()["capturing"] is True
            await _exchange(emu.listen_port, b"over the wire")
            streams = decode_streams((await http.get("/capture")).json())
            assert sorted(streams) == [b"over the wire", b"over the wire"]
            assert (await http.delete("/capture")).json() == {"capturing": False, "captured_bytes": 26}
            assert (await http.get("/capture")).status_code == 404
