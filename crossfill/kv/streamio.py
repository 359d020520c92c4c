"""Receiving side of a KV stream: whole messages, read straight into their own buffers.

A StreamReader copies every byte twice (into its buffer, then out of it) before the decoder copies
it again.  This protocol reads each message body with `recv_into` directly into a bytearray made
for it, which the decoder then views in place: one copy (the kernel's) per KV byte.  Envelopes
are checked as soon as their 16 bytes are in, before a body buffer is allocated, so a forged
length is refused without allocating it.  Reading pauses while too many bytes wait for the
consumer (the sink sets the pace, through TCP flow control back to the sender).
"""

from __future__ import annotations

import asyncio
import collections

from crossfill.kv.errors import Reason, WireError
from crossfill.kv.wire import ENVELOPE, MsgType, parse_envelope

_SCRATCH = 64 * 1024
_PAUSE_BYTES = 16 << 20
_RESUME_BYTES = 4 << 20

Message = tuple[MsgType, int, bytearray]


class MessageStream(asyncio.BufferedProtocol):
    """Protocol that turns a byte stream into (type, reason, body) messages for one consumer."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # largest body accepted; the consumer raises it once a manifest is known
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(_SCRATCH)
        self._have = 0
        self._start = 0
        self._body: bytearray | None = None
        self._body_pos = 0
        self._head: tuple[MsgType, int] | None = None
        self._ready: collections.deque[Message | WireError | None] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._queued = 0
        self._paused = False  # reading paused: too many bytes wait for the consumer
        self._held = False  # reading paused: an envelope waits for the consumer to raise the limit
        self._closed = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._out: list[bytes] = []

    # -- protocol callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._body_pos:]
        if self._start:
            left = self._have - self._start
            self._scratch[:left] = self._scratch[self._start:self._have]
            self._have, self._start = left, 0
        return memoryview(self._scratch)[self._have:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._body_pos += nbytes
            if self._body_pos == len(self._body):
                assert self._head is not None
                self._push((self._head[0], self._head[1], self._body))
                self._body = self._head = None
            return
        self._have += nbytes
        self._parse()

    def eof_received(self) -> bool:
        self._push(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._push(None)
        self._can_write.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- parsing --------------------------------------------------------------------------
    def _parse(self) -> None:
        while self._have - self._start >= ENVELOPE.size:
            try:
                kind, reason, body_len = self._envelope(self._start)
            except WireError as exc:
                if exc.reason is Reason.OVERSIZED and self._ready:
                    # The limit may rise once the consumer has read the messages before this one
                    # (a manifest sets the frame size): hold this envelope until they are consumed.
                    self._held = True
                    self._pause()
                    return
                self._push(exc)
                if self.transport is not None:
                    self.transport.pause_reading()  # the stream is lost; the consumer answers and closes
                self._have = self._start = 0
                return
            self._start += ENVELOPE.size
            body = bytearray(body_len)
            take = min(body_len, self._have - self._start)
            body[:take] = self._scratch[self._start:self._start + take]
            self._start += take
            if take < body_len:
                self._body, self._body_pos, self._head = body, take, (kind, reason)
                break
            self._push((kind, reason, body))
        if self._start == self._have:
            self._start = self._have = 0

    def _envelope(self, at: int) -> tuple[MsgType, int, int]:
        return parse_envelope(bytes(self._scratch[at:at + ENVELOPE.size]), self.limit)

    def _push(self, item: Message | WireError | None) -> None:
        self._ready.append(item)
        if isinstance(item, tuple):
            self._queued += len(item[2])
            if self._queued > _PAUSE_BYTES and not self._paused:
                self._paused = True
                self._pause()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- consumer side --------------------------------------------------------------------
    async def next(self) -> Message | None:
        """The next message, None at the end of the stream; raises WireError for a broken envelope."""
        while not self._ready:
            if self._held:  # everything before the held envelope is consumed: look at it again
                self._held = False
                self._parse()
                self._maybe_resume()
                continue
            self.flush()  # never sit on answers while waiting for more input
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        item = self._ready.popleft()
        if isinstance(item, WireError):
            raise item
        if item is None:
            self._ready.appendleft(None)  # stays at the end
            return None
        self._queued -= len(item[2])
        if self._paused and self._queued < _RESUME_BYTES:
            self._paused = False
            self._maybe_resume()
        return item

    def _pause(self) -> None:
        if self.transport is not None and not self._closed:
            self.transport.pause_reading()

    def _maybe_resume(self) -> None:
        if not (self._paused or self._held) and self.transport is not None and not self._closed:
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        """Queue an answer; answers go out together when no further message is waiting (flush),
        one send for many acknowledgements instead of a system call each."""
        self._out.append(data)
        if not self._ready or sum(map(len, self._out)) > 65536:
            self.flush()

    def flush(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()

    async def drain(self) -> None:
        await self._can_write.wait()

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()


__all__ = ["MessageStream"]
