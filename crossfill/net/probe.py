"""Active probing of a link: a tiny echo endpoint and a periodic RTT prober feeding a LinkMonitor,
and a helper that turns a payload fetch into a bandwidth sample.

Transfers alone leave an idle link unmeasured, and the scheduler must know a link is bad *before*
it sends a long prompt's KV over it. The prober keeps one TCP connection to an echo endpoint on the
far side and times a small request/response every `interval_s` ("echo" mode). "connect" mode times
a fresh TCP handshake instead, which needs no echo endpoint but sees only what the network stack
does (a user-space proxy such as the link emulator answers the handshake itself).

Each probe reports its RTT (`record_rtt`, a measurement for the min filter) and its outcome
(`record_probe`, which drives `up` and closes a half-open circuit breaker). Failures (refused,
reset, no answer within `timeout_s`) are reported as `record_probe(False)`.

RTTs are timed with `time.perf_counter`, not the monitor's clock: they are real durations on this
machine, while the monitor's clock only places samples in its windows (and is faked in tests).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from crossfill.net.link_monitor import LinkMonitor

log = logging.getLogger(__name__)

_PROBE = b"crossfill-probe\n"
_MAX_RTT_SHARE = 0.9  # of a bandwidth probe's elapsed time, at most, is taken as its round trip
_MAX_FRESH_RTT_SHARE = 0.98  # ... when the round trip was measured just before, on the same path


async def _echo_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass  # the prober went away, or the loop is shutting down
    finally:
        writer.close()


async def start_echo_server(host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """Serve the far end of echo probes; the bound port is `server.sockets[0].getsockname()[1]`."""
    return await asyncio.start_server(_echo_handler, host, port)


class LinkProber:
    """Measures RTT to (host, port) every `interval_s` and records it in `monitor`."""

    def __init__(
        self,
        monitor: LinkMonitor,
        host: str,
        port: int,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        mode: Literal["echo", "connect"] = "echo",
    ) -> None:
        if mode not in ("echo", "connect"):
            raise ValueError(f"mode must be 'echo' or 'connect', got {mode!r}")
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s}, {timeout_s}")
        self.monitor = monitor
        self.host, self.port = host, port
        self.interval_s, self.timeout_s, self.mode = interval_s, timeout_s, mode
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._task: asyncio.Task[None] | None = None

    async def probe_once(self) -> float | None:
        """One measurement; returns the RTT in seconds (recorded) or None after a recorded failure."""
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can lose a cancel() racing the inner task
            async with asyncio.timeout(self.timeout_s):
                rtt = await self._measure()
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            log.debug("probe of %s:%d failed: %r", self.host, self.port, exc)
            self._drop_connection()
            self.monitor.record_probe(False)
            return None
        self.monitor.record_rtt(rtt)
        self.monitor.record_probe(True)
        return rtt

    async def start(self) -> None:
        """Probe every `interval_s` in a background task until `stop()`."""
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._drop_connection()

    async def _loop(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval_s)

    async def _measure(self) -> float:
        if self.mode == "connect":
            t0 = time.perf_counter()
            _, writer = await asyncio.open_connection(self.host, self.port)
            rtt = time.perf_counter() - t0
            writer.close()
            return rtt
        if self._conn is None:
            self._conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._conn
        t0 = time.perf_counter()
        writer.write(_PROBE)
        await writer.drain()
        await reader.readexactly(len(_PROBE))
        return time.perf_counter() - t0

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn[1].transport.abort()
            self._conn = None


async def measure_bandwidth(
    fetch: Callable[[], Awaitable[int]],
    monitor: LinkMonitor,
    *,
    clock: Callable[[], float] = time.perf_counter,
    exclude_rtt: bool = True,
) -> float | None:
    """Time one payload fetch across the link and record it as a bandwidth sample.

    `fetch` moves a payload over the link (e.g. an HTTP GET of a few MiB from the far side, read to
    the end) and returns the bytes it received. It is timed from before the request to after the
    last byte, so anything on this machine that is slow (a late event loop, a busy CPU) only adds
    time and lowers the sample, which the monitor's max filter then ignores. A sample timed from
    the first byte instead could count bytes that queued in socket buffers while the loop was late,
    overestimate, and be held by the max filter for a whole window.

    The request and the first byte's way back are one round trip that is not payload on the wire;
    with `exclude_rtt` the monitor's current RTT estimate (its minimum, so never more than the real
    round trip) is subtracted, but never more than `_MAX_RTT_SHARE` of the elapsed time: if the RTT
    estimate is off (stale, another path), a payload too small for the link would otherwise turn into
    a huge sample that the max filter keeps. The cap is generous because on a long link the round
    trip is most of a probe (2 MiB over 1 Gbit/s is 17 ms of wire time beside a 160 ms round trip):
    a tight cap there reads a healthy link as a slow one. Callers should fetch over the same path
    the RTT was measured on. Samples under the monitor's `min_sample_bytes` are ignored by it.

    Returns the sample in Gbit/s, or None when nothing usable was measured. Exceptions from `fetch`
    propagate and nothing is recorded: the caller knows whether its failure is a probe failure.
    """
    rtt_ms = monitor.snapshot().rtt_ms if exclude_rtt else None
    t0 = clock()
    nbytes = await fetch()
    seconds = clock() - t0
    if rtt_ms is not None:
        seconds -= min(rtt_ms / 1e3, seconds * _MAX_RTT_SHARE)
    if nbytes <= 0 or seconds <= 0:
        return None
    monitor.record_bandwidth(nbytes, seconds)
    return nbytes * 8 / seconds / 1e9


async def measure_bandwidth_paired(
    fetch: Callable[[int], Awaitable[int]],
    monitor: LinkMonitor,
    nbytes: int,
    *,
    clock: Callable[[], float] = time.perf_counter,
    rtt_probes: int = 3,
) -> float | None:
    """Like `measure_bandwidth`, but with a round trip measured just before, on the same path.

    `fetch(n)` moves n bytes over the link and returns what it received. The fastest of
    `rtt_probes` one-byte fetches is the round trip now; it is subtracted from the payload fetch.
    The monitor's RTT is a minimum over a window, so for a while after the link's latency rises it
    is the old, lower value: subtracting that would read the added latency as lost bandwidth, and a
    link that got slower to answer would look thinner too. Noise still only adds time to the
    payload fetch; it can add time to the one-byte fetches as well, which is why the fastest of
    several is used and at most `_MAX_FRESH_RTT_SHARE` of the payload fetch is taken off.
    """
    rtt = float("inf")
    for _ in range(max(rtt_probes, 1)):
        t0 = clock()
        await fetch(1)
        rtt = min(rtt, clock() - t0)
    t0 = clock()
    got = await fetch(nbytes)
    seconds = clock() - t0
    seconds -= min(rtt, seconds * _MAX_FRESH_RTT_SHARE)
    if got <= 0 or seconds <= 0:
        return None
    monitor.record_bandwidth(got, seconds)
    return got * 8 / seconds / 1e9
