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

Receiver: one server for all transfers; each stream starts with the manifest, which binds it to an
expected cache id.  Streams are read sequentially, so a slow sink throttles its stream through
TCP flow control.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Assembly, Counters, Expectation, Sink
from crossfill.kv.backend import (
    OutgoingTransfer,
    ReceiveBackend,
    TransferBackend,
    TransferStats,
    aborted_unless_committed,
)
from crossfill.kv.chunker import ChunkError, FrameCutter, encode_piece
from crossfill.kv.errors import Reason, TransferError, WireError
from crossfill.kv.streamio import MessageStream
from crossfill.kv.wire import (
    MAX_MANIFEST_BYTES,
    Frame,
    Manifest,
    MsgType,
    answer,
    commit_body,
    commit_digest,
    manifest_body,
    max_frame_body,
    message,
    parse_answer,
    parse_commit_body,
    parse_frame,
    parse_manifest_body,
    read_message,
)

# Encode in a worker thread only when the codec does real work on a large frame; a plain copy is
# cheaper inline than a thread hand-off under the interpreter lock.
_THREAD_ENCODE_BYTES = 1 << 20
_STREAM_LIMIT = 4 << 20
# Refusals that retrying cannot fix: the transfer fails at once with this reason (all backends).
FATAL_REASONS = frozenset({
    Reason.EXPIRED, Reason.ABORTED, Reason.SINK_ERROR, Reason.TIMEOUT, Reason.FINGERPRINT_MISMATCH,
    Reason.TOKEN_DIGEST_MISMATCH, Reason.TENANT_MISMATCH, Reason.MANIFEST_MISMATCH, Reason.DUPLICATE,
    Reason.COMMIT_DIGEST, Reason.UNKNOWN_VERSION, Reason.NO_RESOURCES,
})


def refused_frame_failure(retries: collections.Counter[int], seq: int, reason: Reason, text: str,
                          max_retry: int) -> tuple[Reason, str] | None:
    """Count a refusal of frame `seq`: the (reason, message) that fails the transfer, or None to resend."""
    if reason in FATAL_REASONS:
        return reason, f"frame {seq} refused: {text}"
    retries[seq] += 1
    if retries[seq] > max_retry:
        return reason, f"frame {seq} refused {retries[seq]} times, last: {text}"
    return None


def parse_endpoint(endpoint: str | tuple[str, int]) -> tuple[str, int]:
    """'host:port' or (host, port) -> (host, port), with a readable error for anything else."""
    if isinstance(endpoint, tuple):
        host, port = endpoint
    else:
        host, sep, port_s = str(endpoint).rpartition(":")
        if not sep or not port_s.isdigit():
            raise ValueError(f"KV endpoint {endpoint!r} must look like 'host:port'")
        port = int(port_s)
    if not 0 < int(port) < 65536:
        raise ValueError(f"KV endpoint {endpoint!r}: port must be 1..65535")
    return str(host).strip("[]"), int(port)


# =============================================================================================
# receiver
# =============================================================================================

class KVReceiver(ReceiveBackend):
    """Data-plane server on the decode side: verifies transfers and feeds their sinks."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, tls: ssl.SSLContext | None = None,
                 timeout_ms: int = 8000, keep_finished: int = 1024) -> None:
        self.host = host
        self._port = port
        self.tls = tls
        self.timeout_s = timeout_ms / 1000
        self._keep_finished = keep_finished
        self._server: asyncio.base_events.Server | None = None
        self._transfers: dict[str, Assembly] = {}
        # Finished transfers stay answerable for a while, so a sender whose commit answer was lost
        # can reconnect and get it again instead of failing a transfer that succeeded.
        self._finished: collections.OrderedDict[str, Assembly] = collections.OrderedDict()
        self._counters = Counters()
        self._conns: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> KVReceiver:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerStream(self), self.host, self._port, ssl=self.tls)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        for a in self._transfers.values():
            a.fail(Reason.ABORTED, "receiver closed")

    async def __aenter__(self) -> KVReceiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def port(self) -> int:
        assert self._server is not None, "call start() first"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    # -- ReceiveBackend -------------------------------------------------------------------
    def expect(self, target: Expectation | str | Manifest, sink: Sink | None = None, *,
               fingerprint: str | None = None, token_digest: str | None = None, tenant: str | None = None,
               timeout_ms: int | None = None, deadline: float | None = None) -> None:
        """Register an expected transfer (call from the event loop).

        `target` is an Expectation, a cache id, or the exact Manifest the decode side requires.
        `deadline` is a time.monotonic() value bounding the whole transfer; `timeout_ms` bounds
        the silence between messages (default: the receiver's timeout_ms).
        """
        if isinstance(target, Expectation):
            exp = target
        else:
            if sink is None:
                raise ValueError("expect() needs a sink callable that imports verified LayerKVChunks")
            manifest = target if isinstance(target, Manifest) else None
            exp = Expectation(
                cache_id=manifest.cache_id if manifest else str(target), sink=sink, fingerprint=fingerprint,
                token_digest=token_digest, tenant=tenant, manifest=manifest,
                timeout_s=(timeout_ms / 1000) if timeout_ms is not None else self.timeout_s, deadline=deadline,
            )
        if exp.cache_id in self._transfers:
            raise ValueError(f"cache id {exp.cache_id!r} is already expected; cache ids must be unique per transfer")
        self._finished.pop(exp.cache_id, None)
        self._transfers[exp.cache_id] = Assembly(exp, self._counters)
        self._counters.add("transfers_expected")

    async def wait(self, cache_id: str) -> Manifest:
        a = self._transfers.get(cache_id)
        if a is None:
            raise TransferError(Reason.UNKNOWN_CACHE_ID, "wait() for a cache id nobody expects", cache_id)
        try:
            while True:
                a.check_time()
                done, _ = await asyncio.wait({a.done}, timeout=min(0.05, a.expect.timeout_s))
                if done:
                    return a.done.result()
        finally:
            self._retire(cache_id)

    def cancel(self, cache_id: str, reason: str = "cancelled by decode") -> None:
        a = self._transfers.get(cache_id)
        if a is not None:
            a.fail(Reason.ABORTED, reason)
            self._retire(cache_id)

    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    def status(self, cache_id: str) -> str:
        """'unknown', 'waiting' (no manifest yet), 'receiving', 'complete' or 'failed:<reason>'."""
        a = self._lookup(cache_id)
        if a is None:
            return "unknown"
        if a.done.done():
            exc = a.done.exception()
            return "complete" if exc is None else f"failed:{exc.reason.label}"  # type: ignore[attr-defined]
        return "waiting" if a.manifest is None else "receiving"

    def transfer_bytes(self, cache_id: str) -> tuple[int, int]:
        """(raw, wire) payload bytes accepted so far for a current or recently finished transfer."""
        a = self._transfers.get(cache_id) or self._finished.get(cache_id)
        return (a.raw_bytes, a.wire_bytes) if a else (0, 0)

    def _retire(self, cache_id: str) -> None:
        a = self._transfers.pop(cache_id, None)
        if a is not None:
            self._finished[cache_id] = a
            while len(self._finished) > self._keep_finished:
                self._finished.popitem(last=False)

    def _lookup(self, cache_id: str) -> Assembly | None:
        return self._transfers.get(cache_id) or self._finished.get(cache_id)

    # -- one stream -----------------------------------------------------------------------
    async def _handle(self, stream: MessageStream) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(stream)
        except (ConnectionError, ssl.SSLError, OSError):
            pass  # the sender reconnects and resends what we did not answer
        finally:
            self._conns.discard(task)
            stream.close()

    async def _serve(self, stream: MessageStream) -> None:
        bound: Assembly | None = None
        while True:
            try:
                item = await stream.next()
            except WireError as exc:
                # The stream cannot be resynchronised after a bad envelope: say why and hang up.
                self._counters.refuse(exc.reason)
                stream.write(answer(MsgType.FRAME_ACK, exc.reason, text=exc.message))
                return
            if item is None:
                return
            kind, _, body = item
            if kind is MsgType.MANIFEST:
                bound, reply = self._on_manifest(bytes(body))
                if bound is not None and bound.manifest is not None:
                    stream.limit = max(MAX_MANIFEST_BYTES, max_frame_body(bound.manifest))
                stream.write(reply)
                stream.flush()  # at once, not batched with frame answers: the sender times this round trip
            elif kind is MsgType.FRAME:
                stream.write(await self._on_frame(bound, body))
            elif kind is MsgType.FRAME_REF:
                stream.write(await self._on_frame_ref(bound, bytes(body)))
            elif kind is MsgType.COMMIT:
                stream.write(await self._on_commit(bound, bytes(body)))
            elif kind is MsgType.ABORT:
                if bound is not None:
                    bound.fail(Reason.ABORTED, "sender aborted: " + body.decode(errors="replace")[:200])
                return
            else:
                self._counters.refuse(Reason.MALFORMED)
                return
            if stream.transport is not None and stream.transport.get_write_buffer_size() > (1 << 20):
                await stream.drain()

    def _on_manifest(self, body: bytes) -> tuple[Assembly | None, bytes]:
        try:
            m = parse_manifest_body(body)
        except WireError as exc:
            self._counters.refuse(exc.reason)
            return None, answer(MsgType.MANIFEST_ACK, exc.reason, text=exc.message)
        a = self._lookup(m.cache_id)
        if a is None:
            self._counters.refuse(Reason.UNKNOWN_CACHE_ID)
            return None, answer(MsgType.MANIFEST_ACK, Reason.UNKNOWN_CACHE_ID,
                                text=f"cache id {m.cache_id!r} is not expected here")
        try:
            a.accept_manifest(m)
        except WireError as exc:
            return None, answer(MsgType.MANIFEST_ACK, exc.reason, text=exc.message)
        try:
            text = self._accepted_text(a)
        except WireError as exc:  # accepted, but this receiver cannot serve it: decode learns at once
            self._counters.refuse(exc.reason)
            a.fail(exc.reason, exc.message)
            return None, answer(MsgType.MANIFEST_ACK, exc.reason, text=exc.message)
        return a, answer(MsgType.MANIFEST_ACK, Reason.OK, text=text)

    def _accepted_text(self, a: Assembly) -> str:
        """Text of a manifest's OK answer: what the sender needs besides "go" (nothing, over TCP).

        Raises WireError when the receiver cannot serve the accepted transfer after all.
        """
        return ""

    async def _on_frame_ref(self, bound: Assembly | None, body: bytes) -> bytes:
        """Frames placed in our memory by a one-sided transport; plain TCP receivers have none."""
        self._counters.refuse(Reason.MALFORMED)
        return answer(MsgType.FRAME_ACK, Reason.MALFORMED, 0, "this receiver takes frames inline, not by reference")

    async def _on_frame(self, bound: Assembly | None, body: bytes | bytearray) -> bytes:
        seq = struct.unpack_from("!I", body)[0] if len(body) >= 4 else 0
        if bound is None:
            self._counters.refuse(Reason.UNKNOWN_CACHE_ID)
            return answer(MsgType.FRAME_ACK, Reason.UNKNOWN_CACHE_ID, seq, "frame on a stream with no accepted manifest")
        try:
            frame = parse_frame(body)
            await bound.accept_frame(frame)
        except WireError as exc:
            if exc.reason is Reason.MALFORMED:
                self._counters.refuse(exc.reason)
            return answer(MsgType.FRAME_ACK, exc.reason, seq, exc.message)
        return answer(MsgType.FRAME_ACK, Reason.OK, seq)

    async def _on_commit(self, bound: Assembly | None, body: bytes) -> bytes:
        if bound is None:
            self._counters.refuse(Reason.UNKNOWN_CACHE_ID)
            return answer(MsgType.COMMIT_ACK, Reason.UNKNOWN_CACHE_ID, text="commit on a stream with no accepted manifest")
        try:
            count, digest = parse_commit_body(body)
        except WireError as exc:
            self._counters.refuse(exc.reason)
            return answer(MsgType.COMMIT_ACK, exc.reason, text=exc.message)
        try:
            missing = await bound.accept_commit(count, digest, grace_s=min(1.0, bound.expect.timeout_s / 2))
        except WireError as exc:
            return answer(MsgType.COMMIT_ACK, exc.reason, text=exc.message)
        if missing:
            return answer(MsgType.COMMIT_ACK, Reason.INCOMPLETE, text=f"{len(missing)} frames missing",
                          missing=missing[:16000])
        return answer(MsgType.COMMIT_ACK, Reason.OK)


class _ServerStream(MessageStream):
    """One accepted stream; its consumer task runs the receiver's protocol."""

    def __init__(self, receiver: KVReceiver) -> None:
        super().__init__(MAX_MANIFEST_BYTES)
        self.receiver = receiver

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self.receiver._handle(self))


# =============================================================================================
# sender
# =============================================================================================

class KVSender(TransferBackend):
    """Sends transfers to one KVReceiver endpoint."""

    name = "tcp"

    def __init__(self, endpoint: str | tuple[str, int], *, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, connections: int = 4, timeout_ms: int = 8000,
                 max_retry: int = 2, max_inflight_bytes: int = 32 << 20, stripe_min_rtt_ms: float = 5.0) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if timeout_ms <= 0 or max_retry < 0:
            raise ValueError(f"timeout_ms must be > 0 and max_retry >= 0, got {timeout_ms} and {max_retry}")
        self.tls = tls
        self.server_hostname = server_hostname if server_hostname is not None else (self.host if tls else None)
        self.connections = connections
        self.timeout_s = timeout_ms / 1000
        self.max_retry = max_retry
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

    @contextlib.asynccontextmanager
    async def open(self, manifest: Manifest) -> AsyncIterator[OutgoingTransfer]:
        tx = _TcpTransfer(self, manifest)
        tx.start()
        async with aborted_unless_committed(tx):
            yield tx


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


class _TcpTransfer(OutgoingTransfer):
    def __init__(self, sender: KVSender, manifest: Manifest) -> None:
        self.s = sender
        self.m = manifest
        self.cutter = FrameCutter(manifest)
        self.frames: dict[int, Frame] = {}
        self.queue: collections.deque[int] = collections.deque()
        self.acked: set[int] = set()
        self.retries: collections.Counter[int] = collections.Counter()
        self.inflight = 0
        self.error: TransferError | None = None
        self.committed = False
        self.closing = False
        self.cond = asyncio.Condition()
        self.conns = [_Conn(i) for i in range(max(1, min(sender.connections, manifest.frame_count)))]
        self.tasks: list[asyncio.Task[None]] = []
        self.raw_bytes = self.wire_bytes = self.retransmits = self.reconnects = 0
        self.t_open = time.monotonic()
        self.t_last_send = self.t_open

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.tasks.append(asyncio.create_task(self._watchdog()))
        self._start_streams(self.conns if self.s.stripes_now() else self.conns[:1])

    def _start_streams(self, conns: list[_Conn]) -> None:
        for c in conns:
            if not c.started and not self.closing:
                c.started = True
                self.tasks.append(asyncio.create_task(self._run_conn(c)))

    def _widen(self) -> None:
        """Open the remaining streams (the link turned out long, or the first stream is in trouble)."""
        self._start_streams(self.conns)

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    def _fail(self, reason: Reason, message: str) -> None:
        if self.error is None:
            self.error = TransferError(reason, message, self.m.cache_id)
        for c in self.conns:
            if c.writer is not None:
                c.writer.transport.abort()
            for fut in list(c.commit_waiters) + [f for _, f in c.control]:
                if not fut.done():
                    fut.set_exception(self.error)
                    fut.exception()
        asyncio.get_running_loop().create_task(self._notify())

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    async def _shutdown(self) -> None:
        self.closing = True
        await self._notify()
        for c in self.conns:
            if c.writer is not None:
                c.writer.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.frames.clear()  # unpin: the receiver has acknowledged (or the transfer is over)

    async def abort(self, reason: str) -> None:
        if self.closing:
            return
        for c in self.conns:
            if c.writer is not None and c.ready and not c.writer.is_closing():
                with contextlib.suppress(Exception):
                    c.writer.write(message(MsgType.ABORT, reason.encode()[:1024]))
        self._fail(Reason.ABORTED, reason)
        await self._shutdown()

    # -- OutgoingTransfer -----------------------------------------------------------------
    async def send(self, chunk: LayerKVChunk) -> None:
        self._raise_if_failed()
        if self.committed or self.closing:
            raise RuntimeError("send() after commit() or abort()")
        pieces = self.cutter.cut(chunk)
        for piece in pieces:
            if self.m.codec != "none" and piece.k.numel() * piece.k.element_size() * 2 >= _THREAD_ENCODE_BYTES:
                frame = await asyncio.to_thread(encode_piece, self.m, piece)
            else:
                frame = encode_piece(self.m, piece)
            self._raise_if_failed()
            self.frames[frame.seq] = frame
            self.raw_bytes += frame.raw_len
            self.wire_bytes += frame.payload_len
            self.queue.append(frame.seq)
            async with self.cond:
                self.cond.notify_all()
            # Let the stream tasks write this frame (and read answers) before encoding the next:
            # encoding and sending overlap, and answers are read when they arrive (round trips
            # are timed on them), even when the caller sends a whole cache in one go.
            await asyncio.sleep(0)
        self.t_last_send = time.monotonic()

    async def commit(self) -> TransferStats:
        self._raise_if_failed()
        missing_layers = self.cutter.incomplete()
        if missing_layers:
            raise ChunkError("commit() before all KV was sent: " + "; ".join(missing_layers[:4]))
        digest = commit_digest([self.frames[s].checksum for s in range(self.m.frame_count)])
        body = commit_body(self.m.frame_count, digest)
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
        self.committed = True
        now = time.monotonic()
        stats = TransferStats(
            cache_id=self.m.cache_id, frames=self.m.frame_count, raw_bytes=self.raw_bytes,
            wire_bytes=self.wire_bytes, retransmits=self.retransmits, reconnects=self.reconnects,
            duration_s=now - self.t_open, commit_wait_s=now - self.t_last_send,
            streams=sum(c.started for c in self.conns),
        )
        await self._shutdown()
        return stats

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
        while not self.closing and self.error is None:
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
            except _Retry as exc:
                c.failures += 1
                last = exc.reason, exc.text
            except (OSError, asyncio.IncompleteReadError, TimeoutError, WireError, ssl.SSLError) as exc:
                c.failures += 1
                last = Reason.CONNECTION, f"{type(exc).__name__}: {exc}"
                self._widen()  # a broken stream: let the others carry the frames meanwhile
            finally:
                self._drop_stream(c)
            if self.closing or self.error is not None:
                return
            if c.failures > self.s.max_retry:
                c.dead = True
                if all(x.dead for x in self.conns if x.started):
                    self._fail(last[0], f"{self.s.host}:{self.s.port}: {last[1]} "
                               f"(gave up after {self.s.max_retry} retries)")
                await self._notify()
                return
            self.reconnects += 1
            await asyncio.sleep(min(1.0, 0.05 * 2 ** (c.failures - 1)))

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
        if not self.closing:
            asyncio.get_running_loop().create_task(self._notify())

    async def _write_frames(self, c: _Conn, writer: asyncio.StreamWriter) -> None:
        limit = self.s.max_inflight_bytes
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self.error is not None or self.closing or bool(c.control) or (
                    c.ready and bool(self.queue) and (self.inflight < limit or self.inflight == 0)))
                if self.error is not None or self.closing:
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
        elif reason in (Reason.UNKNOWN_CACHE_ID, Reason.CHECKSUM, Reason.MALFORMED):
            # The decode side may not have registered the cache id yet: retry after a backoff.
            raise _Retry(reason, f"manifest refused: {text}")
        else:
            self._fail(reason, f"manifest refused: {text}")

    def _on_frame_answer(self, seq: int, reason: Reason, text: str) -> None:
        if reason is Reason.OK:
            self.acked.add(seq)
            return
        failure = refused_frame_failure(self.retries, seq, reason, text, self.s.max_retry)
        if failure is not None:
            self._fail(*failure)
            return
        self.retransmits += 1
        self.queue.appendleft(seq)

    async def _watchdog(self) -> None:
        """Abort a stream that has had answers owed for timeout_ms without any arriving."""
        period = min(0.25, self.s.timeout_s / 4)
        while not self.closing and self.error is None:
            await asyncio.sleep(period)
            now = time.monotonic()
            for c in self.conns:
                if c.writer is not None and c.pending and now - c.last_progress > self.s.timeout_s:
                    c.writer.transport.abort()


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a stream task's exception as seen; _run_conn handles it, or the transfer is over."""
    if not task.cancelled():
        task.exception()


class _Retry(Exception):
    def __init__(self, reason: Reason, text: str) -> None:
        super().__init__(text)
        self.reason = reason
        self.text = text


__all__ = ["KVReceiver", "KVSender", "parse_endpoint"]
