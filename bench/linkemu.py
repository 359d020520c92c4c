"""Goodput through the WAN link emulator vs the configured bandwidth, and its overhead vs direct.

    .venv/bin/python bench/linkemu.py [--mb 40] [--repeats 3]

The emulator runs as `crossfill linkemu` in its own process, as it is deployed; one sender and
one receiver share this process, on loopback. Goodput = bytes / (first byte sent -> receiver's ack of the
last byte), so it includes one round trip of latency like a real transfer. Each case is run
`repeats` times interleaved and the median is printed with its ratio to the configured bandwidth
(or to the direct loopback baseline for the unlimited case).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import time

from crossfill.net.units import parse_bandwidth, parse_duration

CASES: list[tuple[str, str | None, str]] = [
    ("direct loopback (baseline)", None, ""),
    ("emulator, unlimited, 0 ms", None, "0ms"),
    ("emulator, 1gbit, 20 ms", "1gbit", "20ms"),
    ("emulator, 200mbit, 20 ms", "200mbit", "20ms"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_listening(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _transfer(port: int, nbytes: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    block = b"\x5a" * (1 << 20)
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        writer.write(block[: min(len(block), nbytes - sent)])
        sent += min(len(block), nbytes - sent)
        await writer.drain()
    writer.write_eof()
    assert await reader.read() == b"ok"
    writer.close()
    return time.perf_counter() - t0


async def main(mb: int, repeats: int) -> None:
    nbytes = mb << 20

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while data := await reader.read(1 << 20):
            got += len(data)
        writer.write(b"ok" if got == nbytes else b"short")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0, limit=1 << 21)
    up = server.sockets[0].getsockname()[:2]
    times: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    for _ in range(repeats):
        for name, bw, lat in CASES:
            if not lat:
                times[name].append(await _transfer(up[1], nbytes))
                continue
            port = free_port()
            args = ["--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{up[1]}", "--latency", lat]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "crossfill.cli", "linkemu", *args, *(["--bandwidth", bw] if bw else []),
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            try:
                await _wait_listening(port)
                times[name].append(await _transfer(port, nbytes))
            finally:
                proc.terminate()
                await proc.wait()
    server.close()
    base = nbytes * 8 / statistics.median(times[CASES[0][0]])
    print(f"{mb} MiB per transfer, median of {repeats} runs, one connection, 2-core machine")
    for name, bw, lat in CASES:
        gbps = nbytes * 8 / statistics.median(times[name])
        if bw is None:
            ratio = f"{gbps / base:.2f}x of direct"
        else:
            # a perfect link needs serialisation time plus one round trip (data there, ack back)
            ideal = nbytes * 8 / (nbytes * 8 / parse_bandwidth(bw) + 2 * parse_duration(lat))
            ratio = f"{gbps / parse_bandwidth(bw):.2f}x of configured, {gbps / ideal:.2f}x of an ideal link"
        print(f"  {name:30s} {gbps / 1e9:7.3f} Gbit/s   {ratio}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    asyncio.run(main(a.mb, a.repeats))
