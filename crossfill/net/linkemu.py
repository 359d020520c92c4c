"""A WAN link emulator: an asyncio TCP proxy that shapes traffic like an inter-DC link.

Why a proxy and not `tc netem`: it needs no privileges or network namespaces, runs in-process in a
test, and can be steered at run time (settings and faults) through a tiny HTTP API, so every KV
transfer test and benchmark can put a realistic link between prefill and decode on loopback.

Model, per direction ("up" = client -> upstream, "down" = upstream -> client):
- Bandwidth: one serial transmitter per direction, shared by every connection like a real link. A
  chunk of n bytes occupies the link for n*8/bandwidth seconds; the proxy stops reading a
  connection while its chunk is "on the wire", so a fast sender is held back by TCP flow control,
  as behind a real bottleneck. A small credit (`_BURST_S`) absorbs event-loop wake-up lateness so
  lost time does not lower the achieved rate. Bandwidth counts payload bytes (TCP/IP header
  overhead is not emulated), so it is the goodput ceiling.
- Latency: each chunk is delivered `latency` (+ jitter) after it left the transmitter. Chunks are
  queued, not waited on one by one, so a long transfer is pipelined and reaches the full bandwidth
  (the queue holds about one bandwidth-delay product). Delivery order is kept (TCP is ordered):
  a chunk is never delivered before the one sent ahead of it.
- Jitter: uniform in [-jitter, +jitter] around the latency (never below zero).
- Loss: TCP hides loss from the application, so a lost segment (MSS-sized, independent with
  probability `loss`) shows up as extra delay: the retransmission after max(200 ms, RTT), the
  Linux minimum RTO or one round trip. Data behind it waits too (head-of-line blocking), then
  arrives in a burst, as with SACK recovery. Lost segments are counted. Not modelled: TCP's
  congestion-window cut after a loss, which on a real long path caps one flow near
  MSS/RTT * 1.22/sqrt(loss) (Mathis et al.); here loss costs latency, not rate.

Faults, armed at run time (`arm()` or `POST /faults`), act on the next bytes through the link:
- cut_after_bytes=N: after N more bytes in the chosen direction (all connections together), every
  open connection is aborted on both sides (the N bytes themselves are delivered first).
- corrupt_bytes=K: flip all bits of each of the next K bytes in the chosen direction.
- stall_ms=T: nothing is transmitted or delivered in either direction for T milliseconds.
- partition_ms=T: the link is down for T milliseconds. Like a stall, nothing crosses in either
  direction on open connections (their bytes wait, as TCP retransmits across a short partition);
  in addition a connection opened meanwhile is held — not forwarded upstream — until the partition
  ends, so the far side sees nothing of it before then. Afterwards traffic resumes by itself.
- reorder_ms=R: until disarmed, every chunk gets an extra delay drawn uniformly in [0, R] ms.
  Order within one connection is kept (TCP is ordered), so the effect is between connections:
  frames striped over parallel streams arrive out of order relative to each other.

Capture (`start_capture()` or `POST /capture`): every byte that crosses, per connection and
direction, is recorded in memory (crossfill.net.capture) — what an eavesdropper on the WAN sees.

The TCP handshake itself is not delayed (the proxy accepts at once); the first byte still pays the
one-way latency, so request/response round trips measure 2 x latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from crossfill.net.capture import DEFAULT_MAX_BYTES, Capture
from crossfill.net.units import (
    UnitError,
    format_bandwidth,
    parse_bandwidth,
    parse_duration,
    parse_hostport,
    parse_loss,
)

log = logging.getLogger(__name__)

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down")

MSS = 1448  # bytes of payload in one TCP segment on a 1500-byte MTU path
RTO_MIN_S = 0.2  # Linux's minimum retransmission timeout
_BURST_S = 0.01  # transmitter credit (a 10 ms token bucket) that absorbs event-loop wake-up lateness
_MIN_CHUNK = 16 * 1024
_MAX_CHUNK = 256 * 1024
_QUEUE_CHUNKS = 512  # per connection and direction: bounds memory to ~128 MiB in the worst case


@dataclass
class LinkSettings:
    """The emulated link. `bandwidth_bps=None` means unlimited."""

    bandwidth_bps: float | None = None
    latency_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "bandwidth": format_bandwidth(self.bandwidth_bps),
            "bandwidth_bps": self.bandwidth_bps,
            "latency_ms": self.latency_s * 1e3,
            "jitter_ms": self.jitter_s * 1e3,
            "loss": self.loss,
            "loss_percent": self.loss * 100,
        }


@dataclass
class DirectionCounters:
    """Byte and event counters of one direction, cumulative since the emulator started."""

    bytes_in: int = 0  # read from the sending side
    bytes_out: int = 0  # delivered to the receiving side
    chunks: int = 0
    lost_segments: int = 0
    corrupted_bytes: int = 0


@dataclass
class LinkCounters:
    up: DirectionCounters = field(default_factory=DirectionCounters)
    down: DirectionCounters = field(default_factory=DirectionCounters)
    connections_total: int = 0
    connections_open: int = 0
    upstream_connect_errors: int = 0
    cuts: int = 0
    stalls: int = 0
    partitions: int = 0
    held_connections: int = 0  # new connections a partition held before forwarding them
    reordered_chunks: int = 0  # chunks given an extra reorder delay


@dataclass
class Faults:
    """Faults armed and not yet used up; `direction` applies to cut and corrupt."""

    cut_after_bytes: int | None = None
    corrupt_bytes: int = 0
    direction: Direction = "up"
    reorder_ms: float = 0.0  # stays until disarmed (or armed again with 0)


class _Transmitter:
    """The serial link of one direction: schedules departures and draws losses."""

    def __init__(self, emu: LinkEmulator, counters: DirectionCounters) -> None:
        self._emu = emu
        self._counters = counters
        self.next_free = 0.0
        self._segments_to_loss: float = math.inf
        self._loss_for: float = 0.0

    def depart_at(self, nbytes: int, now: float) -> float:
        """Reserve the link for `nbytes`; return when the last byte has left."""
        bw = self._emu.settings.bandwidth_bps
        if bw is None:
            self.next_free = max(self.next_free, now)
            return self.next_free
        start = max(self.next_free, now - _BURST_S)
        self.next_free = start + nbytes * 8 / bw
        return max(self.next_free, now)  # the credit speeds up the link, never time travel

    def one_way_delay(self, nbytes: int) -> float:
        """Latency + jitter + retransmission delay of any segment of this chunk that was lost."""
        s = self._emu.settings
        delay = s.latency_s
        if s.jitter_s:
            delay = max(0.0, delay + self._emu.rng.uniform(-s.jitter_s, s.jitter_s))
        lost = self._draw_losses(math.ceil(nbytes / MSS), s.loss)
        if lost:
            self._counters.lost_segments += lost
            delay += max(RTO_MIN_S, 2 * s.latency_s)
        return delay

    def _draw_losses(self, segments: int, p: float) -> int:
        # Gaps between losses are geometric: one random draw per loss, not one per segment.
        if p <= 0:
            return 0
        if p != self._loss_for:
            self._loss_for, self._segments_to_loss = p, self._gap(p)
        lost = 0
        self._segments_to_loss -= segments
        while self._segments_to_loss <= 0:
            lost += 1
            self._segments_to_loss += self._gap(p)
        return lost

    def _gap(self, p: float) -> float:
        return math.floor(math.log(1.0 - self._emu.rng.random()) / math.log(1.0 - p)) + 1


_CUT = object()  # queue sentinel: abort the connection after what is queued before it


class _Connection:
    """One proxied client connection: two pumps (up, down), each a reader and a deliverer."""

    def __init__(
        self,
        emu: LinkEmulator,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.emu = emu
        self.client = client
        self.upstream = upstream
        self.closed = False
        self.id = emu.counters.connections_total  # names its streams in a capture

    async def run(self) -> None:
        try:
            await asyncio.gather(
                self._pump("up", self.client[0], self.upstream[1]),
                self._pump("down", self.upstream[0], self.client[1]),
            )
        finally:
            self.abort() if self.closed else self._close()

    def abort(self) -> None:
        """Cut both sides at once (RST where the OS does that for an abort)."""
        self.closed = True
        for _, writer in (self.client, self.upstream):
            writer.transport.abort()

    def _close(self) -> None:
        self.closed = True
        for _, writer in (self.client, self.upstream):
            writer.close()

    async def _pump(
        self, direction: Direction, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        emu = self.emu
        loop = asyncio.get_running_loop()
        tx = emu._tx[direction]
        counters: DirectionCounters = getattr(emu.counters, direction)
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=_QUEUE_CHUNKS)
        deliverer = asyncio.create_task(self._deliver(queue, writer, counters))
        last_delivery = 0.0
        try:
            while not self.closed:
                data = await reader.read(emu._chunk_bytes())
                if not data:
                    break
                counters.bytes_in += len(data)
                data, cut_now = emu._apply_faults(direction, data)
                if emu.capture is not None:
                    emu.capture.record(self.id, direction, data)
                now = loop.time()
                depart = max(tx.depart_at(len(data), now), emu._stall_until)
                if depart > now:
                    await emu._hold_until(depart)
                    depart = min(depart, loop.time())  # a disarm ended the hold early: leave now
                delay = tx.one_way_delay(len(data)) + emu._reorder_delay()
                deliver_at = max(depart + delay, last_delivery)  # never ahead of this connection's bytes
                last_delivery = deliver_at
                if data:
                    await queue.put((deliver_at, data))
                if cut_now:
                    await queue.put(_CUT)
                    emu._cut_others(self)
                    break
        except (ConnectionError, OSError):
            self.closed = True
        finally:
            if self.closed:
                deliverer.cancel()
            else:
                await queue.put(None)  # the deliverer never stops consuming before it sees this
            with contextlib.suppress(asyncio.CancelledError):
                await deliverer

    async def _deliver(
        self, queue: asyncio.Queue[Any], writer: asyncio.StreamWriter, counters: DirectionCounters
    ) -> None:
        loop = asyncio.get_running_loop()
        emu = self.emu
        while True:
            item = await queue.get()
            if item is None:
                if not self.closed and writer.can_write_eof():
                    with contextlib.suppress(ConnectionError, OSError):
                        writer.write_eof()  # half-close: the other direction may still be talking
                return
            if item is _CUT:
                emu.counters.cuts += 1
                self.abort()
                return
            if self.closed:
                continue  # keep consuming so the pump never blocks on a full queue
            deliver_at, data = item
            if max(deliver_at, emu._stall_until) > loop.time():
                await emu._hold_until(max(deliver_at, emu._stall_until))
            if self.closed:
                continue
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                self.abort()
                continue
            counters.bytes_out += len(data)
            counters.chunks += 1


class LinkEmulator:
    """TCP proxy `listen` -> `upstream` that emulates a WAN link; see the module docstring.

    Use `await start()` / `await stop()` (or `async with`), then connect to `listen_port`. Settings
    take the CLI's units: bandwidth '1gbit' (a number = bits/s), latency/jitter '20ms' (a number =
    ms), loss '0.1%' (a number = fraction). `control` ('HOST:PORT') also serves the HTTP control API
    (see `crossfill.net.linkemu_control`); its bound port is `control_port`.
    """

    def __init__(
        self,
        upstream: str | tuple[str, int],
        listen: str | tuple[str, int] = ("127.0.0.1", 0),
        bandwidth: str | float | None = None,
        latency: str | float = 0,
        jitter: str | float = 0,
        loss: str | float = 0,
        control: str | tuple[str, int] | None = None,
        seed: int | None = None,
    ) -> None:
        self.upstream = parse_hostport(upstream, "upstream") if isinstance(upstream, str) else upstream
        self.listen = parse_hostport(listen, "listen") if isinstance(listen, str) else listen
        self.control = parse_hostport(control, "control") if isinstance(control, str) else control
        self.settings = LinkSettings()
        self.update(bandwidth=bandwidth, latency=latency, jitter=jitter, loss=loss)
        self.counters = LinkCounters()
        self.faults = Faults()
        self.rng = random.Random(seed)
        self._tx = {d: _Transmitter(self, getattr(self.counters, d)) for d in DIRECTIONS}
        self._stall_until = 0.0
        self._partition_until = 0.0
        self._disarmed = asyncio.Event()  # replaced at each disarm: wakes everything a stall holds
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._control_server: Any = None
        self.capture: Capture | None = None  # what crosses, while a capture is armed
        self.listen_port: int = 0
        self.control_port: int = 0

    # ------------------------------------------------------------------ settings and faults

    _UNSET: Any = object()

    def update(
        self,
        bandwidth: str | float | None = _UNSET,
        latency: str | float = _UNSET,
        jitter: str | float = _UNSET,
        loss: str | float = _UNSET,
    ) -> LinkSettings:
        """Change some settings at run time (all-or-nothing: a bad value changes nothing).

        Raises `UnitError` naming the value that could not be parsed.
        """
        new = LinkSettings(**asdict(self.settings))
        if bandwidth is not self._UNSET:
            new.bandwidth_bps = None if bandwidth is None else parse_bandwidth(bandwidth)
        if latency is not self._UNSET:
            new.latency_s = parse_duration(latency)
        if jitter is not self._UNSET:
            new.jitter_s = parse_duration(jitter)
        if loss is not self._UNSET:
            new.loss = parse_loss(loss)
        self.settings = new
        return new

    def arm(
        self,
        cut_after_bytes: int | None = None,
        corrupt_bytes: int | None = None,
        stall_ms: float | None = None,
        direction: Direction = "up",
        partition_ms: float | None = None,
        reorder_ms: float | None = None,
    ) -> Faults:
        """Arm faults on the next bytes through the link (see the module docstring)."""
        if direction not in DIRECTIONS:
            raise UnitError(f"direction {direction!r} must be 'up' (client->upstream) or 'down'")
        for name, value in (
            ("cut_after_bytes", cut_after_bytes),
            ("corrupt_bytes", corrupt_bytes),
            ("stall_ms", stall_ms),
            ("partition_ms", partition_ms),
            ("reorder_ms", reorder_ms),
        ):
            if value is not None and value < 0:
                raise UnitError(f"{name} must be >= 0, got {value}")
        self.faults.direction = direction
        if cut_after_bytes is not None:
            self.faults.cut_after_bytes = int(cut_after_bytes)
            if cut_after_bytes == 0:
                self._cut_others(None)
                self.faults.cut_after_bytes = None
        if corrupt_bytes is not None:
            self.faults.corrupt_bytes = int(corrupt_bytes)
        if reorder_ms is not None:
            self.faults.reorder_ms = float(reorder_ms)
        if stall_ms:
            with contextlib.suppress(RuntimeError):
                self._hold_traffic(asyncio.get_running_loop().time() + stall_ms / 1e3)
                self.counters.stalls += 1
        if partition_ms:
            with contextlib.suppress(RuntimeError):
                until = asyncio.get_running_loop().time() + partition_ms / 1e3
                self._partition_until = max(self._partition_until, until)
                self._hold_traffic(until)  # open connections: nothing crosses, as in a stall
                self.counters.partitions += 1
        return self.faults

    def _hold_traffic(self, until: float) -> None:
        """Transmit and deliver nothing, in either direction, before loop time `until`."""
        self._stall_until = max(self._stall_until, until)
        for tx in self._tx.values():
            tx.next_free = max(tx.next_free, self._stall_until)

    def disarm(self) -> None:
        """Drop every armed fault and end a stall or partition now (what they hold moves on at once)."""
        self.faults = Faults()
        self._stall_until = 0.0
        self._partition_until = 0.0
        with contextlib.suppress(RuntimeError):
            now = asyncio.get_running_loop().time()
            for tx in self._tx.values():
                tx.next_free = min(tx.next_free, now)  # a stall pushed the shaper's clock ahead
        self._disarmed.set()
        self._disarmed = asyncio.Event()

    async def _hold_until(self, when: float) -> None:
        """Sleep until loop time `when`, or less if the faults are disarmed meanwhile."""
        left = when - asyncio.get_running_loop().time()
        if 0 < left < 1.0:
            await asyncio.sleep(left)  # shaping and latency: the cheap path, per chunk
        elif left > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._disarmed.wait(), left)

    def start_capture(self, max_bytes: int = DEFAULT_MAX_BYTES) -> Capture:
        """Record every byte that crosses from now on, both directions (a fresh, empty capture)."""
        self.capture = Capture(max_bytes)
        return self.capture

    def stop_capture(self) -> Capture | None:
        """Stop recording; returns what was captured."""
        capture, self.capture = self.capture, None
        return capture

    def status(self) -> dict[str, Any]:
        """Settings, armed faults and counters as JSON-ready data (the control API's GET /link)."""
        loop_now = asyncio.get_running_loop().time()
        return {
            "listen": f"{self.listen[0]}:{self.listen_port}",
            "upstream": f"{self.upstream[0]}:{self.upstream[1]}",
            "settings": self.settings.as_json(),
            "faults": {
                **asdict(self.faults),
                "stall_remaining_ms": max(0.0, self._stall_until - loop_now) * 1e3,
                "partition_remaining_ms": max(0.0, self._partition_until - loop_now) * 1e3,
            },
            "counters": asdict(self.counters),
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.listen[0], self.listen[1], limit=_MAX_CHUNK * 2
        )
        self.listen_port = self._server.sockets[0].getsockname()[1]
        if self.control is not None:
            from crossfill.net.linkemu_control import ControlServer  # FastAPI only when asked for

            self._control_server = ControlServer(self, *self.control)
            await self._control_server.start()
            self.control_port = self._control_server.port
        log.info(
            "link emulator %s:%d -> %s:%d, %s",
            self.listen[0],
            self.listen_port,
            *self.upstream,
            self.settings.as_json(),
        )

    async def stop(self) -> None:
        if self._control_server is not None:
            await self._control_server.stop()
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()
        if self._tasks:  # aborted connections wind down by themselves within a wake-up or two
            _, pending = await asyncio.wait(list(self._tasks), timeout=1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def __aenter__(self) -> LinkEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ internals

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._wait_out_partition()
            try:
                up = await asyncio.open_connection(*self.upstream, limit=_MAX_CHUNK * 2)
            except OSError as exc:
                self.counters.upstream_connect_errors += 1
                log.warning("link emulator: upstream %s:%d refused: %s", *self.upstream, exc)
                writer.transport.abort()
                return
            conn = _Connection(self, (reader, writer), up)
            self._connections.add(conn)
            self.counters.connections_total += 1
            self.counters.connections_open += 1
            try:
                await conn.run()
            finally:
                self._connections.discard(conn)
                self.counters.connections_open -= 1
        except asyncio.CancelledError:
            pass  # stop() gave up waiting; asyncio's server callback would log a cancelled handler
        finally:
            self._tasks.discard(task)

    async def _wait_out_partition(self) -> None:
        """Hold a new connection while the link is partitioned (a partition armed meanwhile extends it)."""
        loop = asyncio.get_running_loop()
        if self._partition_until <= loop.time():
            return
        self.counters.held_connections += 1
        while self._partition_until > loop.time():
            await self._hold_until(self._partition_until)

    def _reorder_delay(self) -> float:
        """Extra delay of one chunk while reordering is armed (uniform in [0, reorder_ms])."""
        if self.faults.reorder_ms <= 0:
            return 0.0
        self.counters.reordered_chunks += 1
        return self.rng.uniform(0.0, self.faults.reorder_ms / 1e3)

    def _chunk_bytes(self) -> int:
        # About 2 ms of link time per chunk: fine-grained shaping, few wake-ups at high rates.
        bw = self.settings.bandwidth_bps
        if bw is None:
            return _MAX_CHUNK
        return int(min(_MAX_CHUNK, max(_MIN_CHUNK, bw / 8 * 0.002)))

    def _apply_faults(self, direction: Direction, data: bytes) -> tuple[bytes, bool]:
        """Corrupt and/or truncate `data` per the armed faults; return (data, cut the link now)."""
        f = self.faults
        if f.direction != direction:
            return data, False
        cut = False
        if f.cut_after_bytes is not None:
            if len(data) >= f.cut_after_bytes:
                data, cut = data[: f.cut_after_bytes], True
                f.cut_after_bytes = None
            else:
                f.cut_after_bytes -= len(data)
        if f.corrupt_bytes and data:
            k = min(f.corrupt_bytes, len(data))
            flipped = bytes(b ^ 0xFF for b in data[:k])
            data = flipped + data[k:]
            f.corrupt_bytes -= k
            getattr(self.counters, direction).corrupted_bytes += k
        return data, cut

    def _cut_others(self, keep: _Connection | None) -> None:
        """Abort every open connection but `keep` (which aborts itself after its last bytes)."""
        for conn in list(self._connections):
            if conn is not keep and not conn.closed:
                self.counters.cuts += 1
                conn.abort()
