"""The link emulator's partition and reorder faults (what `crossfill chaos` uses on the WAN).

Only lower bounds on time are asserted (a loaded machine makes things later, never earlier); the
rest waits for events: counters, accepted connections, bytes arriving.
"""

from __future__ import annotations

import asyncio
import struct

import httpx
import pytest

from crossfill.net.linkemu import LinkEmulator

from .conftest import ping, wait_for

pytestmark = pytest.mark.timeout(60)


class Upstream:
    """An echo server that also records when it accepted each connection and what each one sent."""

    def __init__(self) -> None:
        self.accepted_at: list[float] = []
        self.streams: list[bytearray] = []
        self.arrivals: list[tuple[int, bytes]] = []  # (connection index, bytes) in arrival order
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Upstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted_at.append(asyncio.get_running_loop().time())
        idx = len(self.streams)
        self.streams.append(bytearray())
        try:
            while data := await reader.read(65536):
                self.streams[idx] += data
                self.arrivals.append((idx, data))
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def test_partition_holds_open_and_new_connections_until_it_ends() -> None:
    async with Upstream() as upstream, LinkEmulator(("127.0.0.1", upstream.port)) as emu:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        await ping(reader, writer)  # the connection is forwarded before the partition
        emu.arm(partition_ms=400)
        ends = emu._partition_until
        assert emu.status()["faults"]["partition_remaining_ms"] > 0
        pinged = asyncio.create_task(ping(reader, writer))
        new_reader, new_writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        await wait_for(lambda: emu.counters.held_connections == 1)
        assert len(upstream.accepted_at) == 1  # held: the far side has not seen the new connection
        await pinged
        # Nothing crossed before the partition ended, in either direction.
        assert loop.time() >= ends
        assert upstream.accepted_at[1:] and upstream.accepted_at[1] >= ends
        await ping(new_reader, new_writer)  # traffic resumes by itself
        assert emu.counters.partitions == 1
        writer.close()
        new_writer.close()


async def test_disarm_ends_a_partition_at_once() -> None:
    async with Upstream() as upstream, LinkEmulator(("127.0.0.1", upstream.port)) as emu:
        emu.arm(partition_ms=600_000)
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.listen_port)
        await wait_for(lambda: emu.counters.held_connections == 1)
        emu.disarm()
        await asyncio.wait_for(ping(reader, writer), 20)  # long before the 600 s partition would end
        assert len(upstream.accepted_at) == 1
        assert emu.status()["faults"]["partition_remaining_ms"] == 0
        writer.close()


async def test_reorder_mixes_connections_but_keeps_each_in_order() -> None:
    async with Upstream() as upstream, LinkEmulator(("127.0.0.1", upstream.port), seed=11) as emu:
        emu.arm(reorder_ms=60)
        conns = [await asyncio.open_connection("127.0.0.1", emu.listen_port) for _ in range(2)]
        n = 40
        for seq in range(n):  # frame `seq` goes on connection seq % 2, as a striped sender would
            _, writer = conns[seq % 2]
            writer.write(struct.pack("!I", seq))
            await writer.drain()
            await asyncio.sleep(0.003)
        await wait_for(lambda: sum(len(s) for s in upstream.streams) == 4 * n)
        for stream in upstream.streams:
            seqs = [v for (v,) in struct.iter_unpack("!I", bytes(stream))]
            assert seqs == sorted(seqs)  # within one TCP connection, bytes stay in order
        arrived = [v for _, data in upstream.arrivals for (v,) in struct.iter_unpack("!I", data)]
        assert sorted(arrived) == list(range(n))
        assert arrived != list(range(n))  # across connections, frames overtook each other
        assert emu.counters.reordered_chunks > 0
        emu.disarm()
        assert emu.faults.reorder_ms == 0
        for _, writer in conns:
            writer.close()


async def test_partition_and_reorder_over_the_control_api(echo_port: int) -> None:
    async with LinkEmulator(("127.0.0.1", echo_port), control="127.0.0.1:0") as emu:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{emu.control_port}", timeout=5,
                                     trust_env=False) as http:
            r = await http.post("/faults", json={"reorder_ms": 25})
            assert r.status_code == 200 and r.json()["faults"]["reorder_ms"] == 25
            r = await http.post("/faults", json={"partition_ms": 60_000})
            assert r.status_code == 200 and r.json()["faults"]["partition_remaining_ms"] > 50_000
            assert r.json()["counters"]["partitions"] == 1
            for body, field in [({"partition_ms": -1}, "partition_ms"), ({"reorder_ms": "lots"}, "reorder_ms")]:
                r = await http.post("/faults", json=body)
                assert r.status_code == 400 and r.json()["field"] == field, r.text
            status = (await http.delete("/faults")).json()
            assert status["faults"]["partition_remaining_ms"] == 0 and status["faults"]["reorder_ms"] == 0
