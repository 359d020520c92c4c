"""The receive-side control server: one TCP (optionally mTLS) server for every backend that needs one.

The TCP backend and the Mooncake TE backend speak the same control protocol (see
docs/KV_WIRE_FORMAT.md): each stream starts with the MANIFEST, which binds it to an expected cache
id; then FRAMEs (inline) or FRAME_REFs (bytes already placed in our memory by a one-sided
transport), the COMMIT, or an ABORT.  The server verifies everything with the shared `Assembly`
and answers every message on the stream it came on, in order.  Streams are read sequentially, so
a slow sink throttles its stream through TCP flow control.

What differs between backends is only how frame bytes arrive, so that is a pluggable `FramePath`:
`InlineFrames` (frames travel on the stream; FRAME_REF is refused) for TCP, and the TE backend's
path, which registers a staging region per transfer, describes it in the manifest's answer and
reads FRAME_REFs out of it.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from typing import Self

from crossfill.kv.assembler import Assembly, Expectation, TransferTable
from crossfill.kv.backend import ReceiveBackend
from crossfill.kv.errors import Reason, TransferError, WireError
from crossfill.kv.listener import Listener, Listens
from crossfill.kv.streamio import MessageStream
from crossfill.kv.wire import (
    MAX_MANIFEST_BYTES,
    Manifest,
    MsgType,
    answer,
    max_frame_body,
    parse_commit_body,
    parse_frame,
    parse_manifest_body,
)


class FramePath:
    """How frame bytes reach the control server.  The default: inline on the stream (TCP)."""

    def accepted_text(self, a: Assembly) -> str:
        """Text of a manifest's OK answer: what the sender needs besides "go" (nothing, inline).

        Raises WireError when the receiver cannot serve the accepted transfer after all.
        """
        return ""

    async def frame_ref(self, server: ControlServer, bound: Assembly | None, body: bytes) -> bytes:
        """Answer a FRAME_REF; a path that takes frames inline has none."""
        return server.refuse(MsgType.FRAME_ACK, Reason.MALFORMED, "this receiver takes frames inline, not by reference")

    def released(self, cache_id: str) -> None:
        """The transfer finished (or was cancelled): free what the path holds for it."""

    def close(self) -> None:
        """The server closed: free everything."""


InlineFrames = FramePath


class ControlServer(Listens, ReceiveBackend):
    """Data-plane server on the decode side: verifies transfers and feeds their sinks.

    `frames` says how frame bytes arrive (default: inline, the TCP backend).  `timeout_ms` is the
    silence bound of an Expectation that does not set its own.
    """

    name = "control"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, frames: FramePath | None = None,
                 tls: ssl.SSLContext | None = None, timeout_ms: int = 8000, keep_finished: int = 1024) -> None:
        self.host = host
        self.tls = tls
        self.listener = Listener(host, port, tls)
        self.frames = frames if frames is not None else InlineFrames()
        self.transfers = TransferTable(timeout_ms / 1000, keep_finished)
        self._counters = self.transfers.counters

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> Self:
        await self.listener.start_protocol(lambda: _ServerStream(self))
        return self

    async def close(self) -> None:
        await self.listener.close()
        for a in self.transfers.active.values():
            a.fail(Reason.ABORTED, "receiver closed")
        self.frames.close()

    @property
    def endpoint(self) -> str:
        return self.address

    # -- ReceiveBackend -------------------------------------------------------------------
    def expect(self, expectation: Expectation) -> None:
        self.transfers.expect(expectation)

    async def wait(self, cache_id: str) -> Manifest:
        a = self.transfers.active.get(cache_id)
        if a is None:
            raise TransferError(Reason.UNKNOWN_CACHE_ID, "wait() for a cache id nobody expects", cache_id)
        assert a.expect.timeout_s is not None
        try:
            while True:
                a.check_time()
                done, _ = await asyncio.wait({a.done}, timeout=min(0.05, a.expect.timeout_s))
                if done:
                    return a.done.result()
        finally:
            self._retire(cache_id)

    def keep_alive(self, cache_id: str) -> bool:
        return self.transfers.keep_alive(cache_id)

    def cancel(self, cache_id: str, reason: str = "cancelled by decode") -> None:
        a = self.transfers.active.get(cache_id)
        if a is not None:
            a.fail(Reason.ABORTED, reason)
            self._retire(cache_id)

    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    def transfer_bytes(self, cache_id: str) -> tuple[int, int]:
        return self.transfers.transfer_bytes(cache_id)

    def status(self, cache_id: str) -> str:
        """'unknown', 'waiting' (no manifest yet), 'receiving', 'complete' or 'failed:<reason>'."""
        a = self.transfers.lookup(cache_id)
        if a is None:
            return "unknown"
        if a.done.done():
            exc = a.done.exception()
            return "complete" if exc is None else f"failed:{exc.reason.label}"  # type: ignore[attr-defined]
        return "waiting" if a.manifest is None else "receiving"

    def _retire(self, cache_id: str) -> None:
        self.transfers.retire(cache_id)
        self.frames.released(cache_id)

    def refuse(self, kind: MsgType, reason: Reason, text: str, seq: int = 0) -> bytes:
        """Count a refusal and build its answer."""
        self._counters.refuse(reason)
        return answer(kind, reason, seq, text)

    # -- one stream -----------------------------------------------------------------------
    async def _handle(self, stream: MessageStream) -> None:
        with self.listener.handling():
            try:
                await self._serve(stream)
            except (ConnectionError, ssl.SSLError, OSError):
                pass  # the sender reconnects and resends what we did not answer
            finally:
                stream.close()

    async def _serve(self, stream: MessageStream) -> None:
        bound: Assembly | None = None
        while True:
            try:
                item = await stream.next()
            except WireError as exc:
                # The stream cannot be resynchronised after a bad envelope: say why and hang up.
                stream.write(self.refuse(MsgType.FRAME_ACK, exc.reason, exc.message))
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
                stream.write(await self.on_frame(bound, body))
            elif kind is MsgType.FRAME_REF:
                stream.write(await self.frames.frame_ref(self, bound, bytes(body)))
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
            return None, self.refuse(MsgType.MANIFEST_ACK, exc.reason, exc.message)
        a = self.transfers.lookup(m.cache_id)
        if a is None:
            return None, self.refuse(MsgType.MANIFEST_ACK, Reason.UNKNOWN_CACHE_ID,
                                     f"cache id {m.cache_id!r} is not expected here")
        try:
            a.accept_manifest(m)
        except WireError as exc:
            return None, answer(MsgType.MANIFEST_ACK, exc.reason, text=exc.message)
        try:
            text = self.frames.accepted_text(a)
        except WireError as exc:  # accepted, but this receiver cannot serve it: decode learns at once
            a.fail(exc.reason, exc.message)
            return None, self.refuse(MsgType.MANIFEST_ACK, exc.reason, exc.message)
        return a, answer(MsgType.MANIFEST_ACK, Reason.OK, text=text)

    async def on_frame(self, bound: Assembly | None, body: bytes | bytearray) -> bytes:
        """Verify one FRAME body (inline, or copied out of a region by the frame path) and answer it."""
        seq = struct.unpack_from("!I", body)[0] if len(body) >= 4 else 0
        if bound is None:
            return self.refuse(MsgType.FRAME_ACK, Reason.UNKNOWN_CACHE_ID, "frame on a stream with no accepted manifest",
                               seq)
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
            return self.refuse(MsgType.COMMIT_ACK, Reason.UNKNOWN_CACHE_ID, "commit on a stream with no accepted manifest")
        try:
            count, digest = parse_commit_body(body)
        except WireError as exc:
            return self.refuse(MsgType.COMMIT_ACK, exc.reason, exc.message)
        assert bound.expect.timeout_s is not None
        try:
            missing = await bound.accept_commit(count, digest, grace_s=min(1.0, bound.expect.timeout_s / 2))
        except WireError as exc:
            return answer(MsgType.COMMIT_ACK, exc.reason, text=exc.message)
        if missing:
            return answer(MsgType.COMMIT_ACK, Reason.INCOMPLETE, text=f"{len(missing)} frames missing",
                          missing=missing[:16000])
        return answer(MsgType.COMMIT_ACK, Reason.OK)


class _ServerStream(MessageStream):
    """One accepted stream; its consumer task runs the server's protocol."""

    def __init__(self, server: ControlServer) -> None:
        super().__init__(MAX_MANIFEST_BYTES)
        self.server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self.server._handle(self))


__all__ = ["ControlServer", "FramePath", "InlineFrames"]
