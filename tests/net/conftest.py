"""Real loopback servers for the link tests: an echo server and a byte sink that times arrivals."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest


@dataclass
class Sink:
    """Counts bytes per connection and records first/last arrival times."""

    port: int = 0
    received: list[bytearray] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    closed: list[bool] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(len(b) for b in self.received)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_port():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


@pytest.fixture
async def sink():
    state = Sink()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = bytearray()
        state.received.append(buf)
        idx = len(state.closed)
        state.closed.append(False)
        try:
            while data := await reader.read(1 << 20):
                now = time.perf_counter()
                state.first = state.first or now
                state.last = now
                buf += data
        except ConnectionError:
            pass
        finally:
            state.closed[idx] = True
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    yield state
    server.close()


async def ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int = 64) -> float:
    """One request/response round trip of `size` bytes through an echo server; seconds."""
    t0 = time.perf_counter()
    writer.write(b"p" * size)
    await writer.drain()
    await reader.readexactly(size)
    return time.perf_counter() - t0


async def wait_for(predicate, timeout: float = 30.0) -> None:
    """Poll `predicate` until it holds (the timeout is only a safety net, far above any wait)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(0.01)
