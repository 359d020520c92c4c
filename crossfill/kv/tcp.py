"""The built-in transfer backend: asyncio TCP, several connections per transfer, optional mTLS.

Sender: frames are striped over up to `connections` parallel streams (each idle stream takes the
next queued frame, so a slow stream simply carries fewer).  Parallel streams pay off on long links,
where one TCP window cannot fill the bandwidth-delay product and a loss halves only one stream's
rate; on a short link (loopback, same rack) they only add system calls and compete for cores.  So a
transfer starts with one stream and opens the others once a manifest round trip to the endpoint
is at least `stripe_min_rtt_ms` (default 5 ms: below it, Linux's default window autotuning of up to
6 MiB already fills 10 Gbit/s with one stream).  The round trip is the minimum of the sender's
last 16 manifest round trips, so a busy event loop on either side (which only adds delay) does
not pass for a long link, and later transfers to a far endpoint open every stream at once.

The receiver answers every frame on the stream it came on, in order, so the sender matches answers
to frames by position (a corrupted header cannot misdirect an answer).  Refused frames are queued
again up to `max_retry` times; when a stream breaks or stalls for `timeout_ms` its unanswered
frames are queued again and the stream reconnects (resending the manifest first), also bounded by
`max_retry`.  Bytes written but not answered are bounded by `max_inflight_bytes`.  Encoded frames
stay pinned until the receiver acknowledges the commit, so any frame can be sent again until then;
with a codec that does not transform the bytes (`none`) a frame is a view of the chunk's tensors,
not a copy, so the caller hands over tensors it no longer writes (the engine's exports are fresh
copies).

Receiver: the shared control server (`control.py`) with frames inline on its streams.  Cutting,
encoding, pinning and the commit digest are the shared sender base's (`sender.py`); this module
owns only how frames and the commit travel over the striped streams.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from dataclasses import dataclass, field

from crossfill.kv.control import ControlServer
from crossfill.kv.errors import Reason, TransferError, WireError
from crossfill.kv.sender import RETRY_MANIFEST, FrameSender, Retry, SenderBackend, parse_endpoint
from crossfill.kv.wire import (
    Frame,
    Manifest,
    MsgType,
    manifest_body,
    message,
    parse_answer,
    read_message,
)

_STREAM_LIMIT = 4 << 20


# =============================================================================================
# receiver
# =============================================================================================

class KVReceiver(ControlServer):
    """The TCP backend's receiver: the shared control server with frames inline on its streams."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, tls: ssl.SSLContext | None = None,
                 timeout_ms: int = 8000, keep_finished: int = 1024) -> None:
        super().__init__(host, port, tls=tls, timeout_ms=timeout_ms, keep_finished=keep_finished)


# =============================================================================================
# sender
# =============================================================================================

class KVSender(SenderBackend):
    """Sends transfers to one KVReceiver endpoint."""

    name = "tcp"

    def __init__(self, endpoint: str | tuple[str, int], *, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, connections: int = 4, timeout_ms: int = 8000,
                 max_retry: int = 2, max_inflight_bytes: int = 32 << 20, stripe_min_rtt_ms: float = 5.0) -> None:
        super().__init__(timeout_ms, max_retry)
        self.host, self.port = parse_endpoint(endpoint)
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.tls = tls
        self.server_hostname = server_hostname if server_hostname is not None else (self.host if tls else None)
        self.connections = connections
        self.max_inflight_bytes = max_inflight_bytes
        if stripe_min_rtt_ms < 0:
            raise ValueError(f"stripe_min_rtt_ms must be >= 0, got {stripe_min_rtt_ms}")
        self.stripe_min_rtt_s = stripe_min_rtt_ms / 1000
        self._rtt_samples: collections.deque[float] = collections.deque(maxlen=16)

    @property
    def rtt_s(self) -> float | None:
        """Round trip to this endpoint: the least of the last manifest round trips (None before any)."""
        return min(self._rtt_samples) if self._rtt_samples else None

    def observe_rtt(self, rtt_s: float) -> None:
        self._rtt_samples.append(rtt_s)

    def stripes_now(self) -> bool:
        """Whether a new transfer should open all its streams at once (far endpoint, or no choice)."""
        return self.connections == 1 or self.stripe_min_rtt_s == 0 or (
            self.rtt_s is not None and self.rtt_s >= self.stripe_min_rtt_s)

    def _transfer(self, manifest: Manifest) -> FrameSender:
        return _TcpTransfer(self, manifest)


@dataclass
class _Conn:
    idx: int
    writer: asyncio.StreamWriter | None = None
    pending: collections.deque[tuple[str, int, int]] = field(default_factory=collections.deque)
    control: collections.deque[tuple[bytes, asyncio.Future[object]]] = field(default_factory=collections.deque)
    commit_waiters: collections.deque[asyncio.Future[object]] = field(default_factory=collections.deque)
    ready: bool = False
    started: bool = False
    dead: bool = False
    manifest_sent_at: float = 0.0
    failures: int = 0
    last_progress: float = field(default_factory=time.monotonic)


class _TcpTransfer(FrameSender):
    def __init__(self, sender: KVSender, manifest: Manifest) -> None:
        super().__init__(manifest)
        self.s = sender
        self.queue: collections.deque[int] = collections.deque()
        self.acked: set[int] = set()
        self.inflight = 0
        self.cond = asyncio.Condition()
        self.conns = [_Conn(i) for i in range(max(1, min(sender.connections, manifest.frame_count)))]
        self.tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.tasks.append(asyncio.create_task(self._watchdog()))
        self._start_streams(self.conns if self.s.stripes_now() else self.conns[:1])

    def _start_streams(self, conns: list[_Conn]) -> None:
        for c in conns:
            if not c.started and not self.closed:
                c.started = True
                self.tasks.append(asyncio.create_task(self._run_conn(c)))

    def _widen(self) -> None:
        """Open the remaining streams (the link turned out long, or the first stream is in trouble)."""
        self._start_streams(self.conns)

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    def _fail(self, reason: Reason, message: str) -> TransferError:
        error = super()._fail(reason, message)
        for c in self.conns:
            if c.writer is not None:
                c.writer.transport.abort()
            for fut in list(c.commit_waiters) + [f for _, f in c.control]:
                if not fut.done():
                    fut.set_exception(error)
                    fut.exception()
        asyncio.get_running_loop().create_task(self._notify())
        return error

    def _streams(self) -> int:
        return sum(c.started for c in self.conns)

    async def _close(self) -> None:
        await self._notify()
        for c in self.conns:
            if c.writer is not None:
                c.writer.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _tell_abort(self, reason: str) -> None:
        for c in self.conns:
            if c.writer is not None and c.ready and not c.writer.is_closing():
                with contextlib.suppress(Exception):
                    c.writer.write(message(MsgType.ABORT, reason.encode()[:1024]))

    # -- how frames and the commit travel ---------------------------------------------------
    async def _ship(self, frame: Frame) -> None:
        self.queue.append(frame.seq)
        async with self.cond:
            self.cond.notify_all()

    async def _deliver_commit(self, body: bytes) -> None:
        attempts = 0
        while True:
            # Commit once every frame is on a stream (not once every frame is acknowledged): the
            # receiver waits for frames still in flight, which saves a round trip at the tail.
            async with self.cond:
                await self.cond.wait_for(lambda: self.error is not None or (
                    not self.queue and any(c.ready for c in self.conns)))
            self._raise_if_failed()
            conn = next(c for c in self.conns if c.ready)
            fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            conn.control.append((message(MsgType.COMMIT, body), fut))
            await self._notify()
            try:
                ans = await self._await_answer(fut)
            except TimeoutError:
                attempts += 1
                if attempts > self.s.max_retry:
                    self._fail(Reason.TIMEOUT, f"no commit acknowledgement within {self.s.timeout_s * 1000:.0f} ms "
                               f"after {attempts} attempts")
                    self._raise_if_failed()
                if conn.writer is not None:
                    conn.writer.transport.abort()  # treat the stream as stalled; it reconnects
                continue
            except asyncio.CancelledError:
                if not fut.cancelled():
                    raise  # this task itself is being cancelled
                if self.error is not None:
                    raise self.error from None
                attempts += 1  # the stream carrying the commit broke; commit again on another
                if attempts > self.s.max_retry + 1:
                    self._fail(Reason.CONNECTION, "streams kept breaking before the commit was acknowledged")
                    self._raise_if_failed()
                continue
            reason, text, missing = ans  # type: ignore[misc]
            if reason is Reason.OK:
                break
            if reason in (Reason.INCOMPLETE, Reason.CHECKSUM) and attempts < self.s.max_retry:
                attempts += 1
                on_streams = {seq for c in self.conns for kind, seq, _ in c.pending if kind == "frame"}
                for seq in missing:
                    if seq not in on_streams and seq not in self.queue:
                        self.acked.discard(seq)
                        self.queue.append(seq)
                        self.retransmits += 1
                await self._notify()
                continue
            self._fail(reason, f"commit refused: {text}")
            self._raise_if_failed()

    async def _await_answer(self, fut: asyncio.Future[object]) -> object:
        """Wait for an answer while streams make progress; TimeoutError after timeout_ms of silence."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.s.timeout_s)
            except TimeoutError:
                if time.monotonic() - max(c.last_progress for c in self.conns) >= self.s.timeout_s:
                    raise

    # -- streams --------------------------------------------------------------------------
    async def _run_conn(self, c: _Conn) -> None:
        """Keep one stream alive until the transfer ends; reconnect within the retry budget."""
        last: tuple[Reason, str] = (Reason.CONNECTION, "stream closed")
        while not self.closed and self.error is None:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.s.host, self.s.port, ssl=self.s.tls,
                                            server_hostname=self.s.server_hostname, limit=_STREAM_LIMIT),
                    self.s.timeout_s)
                c.writer = writer
                c.last_progress = time.monotonic()
                writer.write(message(MsgType.MANIFEST, manifest_body(self.m)))
                c.manifest_sent_at = time.monotonic()
                c.pending.append(("manifest", -1, 0))
                # Frames follow the manifest without waiting for its answer (one round trip less
                # at the start); if it is refused, they are refused too and queued again.
                c.ready = True
                reader_task = asyncio.create_task(self._read_answers(c, reader))
                writer_task = asyncio.create_task(self._write_frames(c, writer))
                for t in (reader_task, writer_task):
                    t.add_done_callback(_retrieve)
                done, _ = await asyncio.wait({reader_task, writer_task}, return_when=asyncio.FIRST_COMPLETED)
                for t in (reader_task, writer_task):
                    t.cancel()
                await asyncio.gather(reader_task, writer_task, return_exceptions=True)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            except asyncio.CancelledError:
                raise
            except Retry as exc:
                c.failures += 1
                last = exc.reason, exc.text
            except (OSError, asyncio.IncompleteReadError, TimeoutError, WireError, ssl.SSLError) as exc:
                c.failures += 1
                last = Reason.CONNECTION, f"{type(exc).__name__}: {exc}"
                self._widen()  # a broken stream: let the others carry the frames meanwhile
            finally:
                self._drop_stream(c)
            if self.closed or self.error is not None:
                return
            if c.failures > self.s.max_retry:
                c.dead = True
                if all(x.dead for x in self.conns if x.started):
                    self._fail(last[0], f"{self.s.host}:{self.s.port}: {last[1]} "
                               f"(gave up after {self.s.max_retry} retries)")
                await self._notify()
                return
            self.reconnects += 1
            await asyncio.sleep(self.reconnect_delay(c.failures))

    def _drop_stream(self, c: _Conn) -> None:
        """Queue the stream's unanswered frames again, at the front: they are the oldest."""
        c.ready = False
        if c.writer is not None:
            c.writer.transport.abort()
            c.writer = None
        for kind, seq, size in reversed(c.pending):
            if kind == "frame":
                self.inflight -= size
                if seq not in self.acked:
                    self.queue.appendleft(seq)
                    self.retransmits += 1
        c.pending.clear()
        for fut in c.commit_waiters:
            if not fut.done():
                fut.cancel()
        c.commit_waiters.clear()
        for _, fut in c.control:
            if not fut.done():
                fut.cancel()
        c.control.clear()
        if not self.closed:
            asyncio.get_running_loop().create_task(self._notify())

    async def _write_frames(self, c: _Conn, writer: asyncio.StreamWriter) -> None:
        limit = self.s.max_inflight_bytes
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self.error is not None or self.closed or bool(c.control) or (
                    c.ready and bool(self.queue) and (self.inflight < limit or self.inflight == 0)))
                if self.error is not None or self.closed:
                    return
                if c.control:
                    data, fut = c.control.popleft()
                    c.pending.append(("commit", -1, 0))
                    c.commit_waiters.append(fut)
                    frame = None
                else:
                    seq = self.queue.popleft()
                    if seq in self.acked:
                        continue
                    frame = self.frames[seq]
                    self.inflight += frame.wire_len
                    c.pending.append(("frame", seq, frame.wire_len))
            if frame is None:
                writer.write(data)
            else:
                writer.write(frame.wire_header())
                for part in frame.parts:
                    writer.write(part)
            await writer.drain()

    async def _read_answers(self, c: _Conn, reader: asyncio.StreamReader) -> None:
        while True:
            kind, reason_code, body = await read_message(reader, 1 << 20)
            ans = parse_answer(kind, reason_code, body)
            if not c.pending:
                raise WireError(Reason.MALFORMED, f"receiver sent an unsolicited {kind.name}: {ans.text}")
            what, seq, size = c.pending.popleft()
            c.last_progress = time.monotonic()
            if what == "manifest":
                self._on_manifest_answer(c, ans.reason, ans.text)
            elif what == "frame":
                self.inflight -= size
                self._on_frame_answer(seq, ans.reason, ans.text)
            else:
                fut = c.commit_waiters.popleft()
                if not fut.done():
                    fut.set_result((ans.reason, ans.text, ans.missing))
            async with self.cond:
                self.cond.notify_all()

    def _on_manifest_answer(self, c: _Conn, reason: Reason, text: str) -> None:
        if reason is Reason.OK:
            c.failures = 0
            self.s.observe_rtt(time.monotonic() - c.manifest_sent_at)
            if self.s.stripes_now():
                self._widen()
        elif reason in RETRY_MANIFEST:
            # The decode side may not have registered the cache id yet: retry after a backoff.
            raise Retry(reason, f"manifest refused: {text}")
        else:
            self._fail(reason, f"manifest refused: {text}")

    def _on_frame_answer(self, seq: int, reason: Reason, text: str) -> None:
        if reason is Reason.OK:
            self.acked.add(seq)
            return
        if self._resend_allowed(seq, reason, text, self.s.max_retry):
            self.queue.appendleft(seq)

    async def _watchdog(self) -> None:
        """Abort a stream that has had answers owed for timeout_ms without any arriving."""
        period = min(0.25, self.s.timeout_s / 4)
        while not self.closed and self.error is None:
            await asyncio.sleep(period)
            now = time.monotonic()
            for c in self.conns:
                if c.writer is not None and c.pending and now - c.last_progress > self.s.timeout_s:
                    c.writer.transport.abort()


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a stream task's exception as seen; _run_conn handles it, or the transfer is over."""
    if not task.cancelled():
        task.exception()


__all__ = ["KVReceiver", "KVSender", "parse_endpoint"]
