"""Transfer backend over Mooncake Transfer Engine (TE): bulk bytes one-sided, control over a small TCP stream.

TE writes straight into memory the receiver registered, but says nothing to the receiver.  So a
transfer keeps the built-in protocol for control (manifest, per-frame notices and answers,
commit; same checks, reasons and counters as the TCP backend) and only the frame bytes move by TE:

1. the sender sends the MANIFEST on a control stream; the receiver accepts it, registers a
   staging region for the transfer and answers with its TE buffer descriptor;
2. per frame, the sender copies the encoded frame into its own registered staging buffer at an
   offset of a ring, TE-writes it to the same offset of the receiver's region, then sends a
   FRAME_REF (offset, length) on the control stream;
3. the receiver copies the frame out of its region, verifies and decodes it exactly like an inline
   frame, hands it to the sink and answers; an answered frame frees its ring space; refused
   frames are written again up to max_retry times;
4. COMMIT as usual.

Limits: one control stream per transfer and no reconnection (a broken stream fails the transfer
with `connection`, and the caller's fallback applies); TE calls block, so they run in a thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Assembly
from crossfill.kv.backend import OutgoingTransfer, TransferBackend, TransferStats
from crossfill.kv.chunker import ChunkError, FrameCutter, encode_piece
from crossfill.kv.errors import Reason, TransferError, WireError
from crossfill.kv.mooncake_te import (
    BufferDescriptor,
    MooncakeTEError,
    MooncakeTransferEngine,
    RegisteredBuffer,
)
from crossfill.kv.tcp import FATAL_REASONS, KVReceiver, parse_endpoint
from crossfill.kv.wire import (
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
    read_message,
)

FRAME_REF = struct.Struct("!QI")
DEFAULT_REGION_BYTES = 64 << 20


class TEReceiver(KVReceiver):
    """KVReceiver whose frames arrive by Mooncake TE into a per-transfer registered region."""

    name = "mooncake-te"

    def __init__(self, engine: MooncakeTransferEngine, host: str = "127.0.0.1", port: int = 0, *,
                 region_bytes: int = DEFAULT_REGION_BYTES, **kw: object) -> None:
        super().__init__(host, port, **kw)  # type: ignore[arg-type]
        self.engine = engine
        self.region_bytes = region_bytes
        self._regions: dict[str, RegisteredBuffer] = {}

    def _accepted_text(self, a: Assembly) -> str:
        region = self._regions.get(a.cache_id)
        if region is None:
            assert a.manifest is not None
            size = max(max_frame_body(a.manifest), min(self.region_bytes, _total_bound(a.manifest)))
            region = self._regions[a.cache_id] = self.engine.allocate(size)
        return self.engine.describe(region).to_json()

    async def _on_frame_ref(self, bound: Assembly | None, body: bytes) -> bytes:
        if bound is None:
            self._counters.refuse(Reason.UNKNOWN_CACHE_ID)
            return answer(MsgType.FRAME_ACK, Reason.UNKNOWN_CACHE_ID, 0, "frame on a stream with no accepted manifest")
        region = self._regions.get(bound.cache_id)
        if len(body) != FRAME_REF.size or region is None:
            self._counters.refuse(Reason.MALFORMED)
            return answer(MsgType.FRAME_ACK, Reason.MALFORMED, 0, "bad FRAME_REF")
        offset, length = FRAME_REF.unpack(body)
        if offset + length > region.nbytes:
            self._counters.refuse(Reason.OVERSIZED)
            return answer(MsgType.FRAME_ACK, Reason.OVERSIZED, 0,
                          f"frame at [{offset}, {offset + length}) outside the {region.nbytes}-byte region")
        data = region.array[offset:offset + length].tobytes()  # copy out before the sender reuses the space
        return await self._on_frame(bound, data)

    def _retire(self, cache_id: str) -> None:
        super()._retire(cache_id)
        region = self._regions.pop(cache_id, None)
        if region is not None:
            self.engine.unregister(region)

    async def close(self) -> None:
        await super().close()
        for cache_id in list(self._regions):
            self.engine.unregister(self._regions.pop(cache_id))


def _total_bound(m: Manifest) -> int:
    return m.frame_count * max_frame_body(m)


class TESender(TransferBackend):
    """Sends transfers to a TEReceiver: control to `endpoint`, bytes by `engine`."""

    name = "mooncake-te"

    def __init__(self, endpoint: str | tuple[str, int], engine: MooncakeTransferEngine, *,
                 timeout_ms: int = 8000, max_retry: int = 2) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self.engine = engine
        self.timeout_s = timeout_ms / 1000
        self.max_retry = max_retry

    @contextlib.asynccontextmanager
    async def open(self, manifest: Manifest) -> AsyncIterator[OutgoingTransfer]:
        tx = _TETransfer(self, manifest)
        try:
            await tx.start()
            yield tx
        except BaseException as exc:
            await tx.abort(f"sender raised {type(exc).__name__}: {exc}")
            raise
        finally:
            if not tx.committed:
                await tx.abort("transfer left without commit()")


@dataclass
class _Slot:
    frame: Frame
    offset: int
    length: int
    done: bool = False


class _TETransfer(OutgoingTransfer):
    def __init__(self, sender: TESender, manifest: Manifest) -> None:
        self.s = sender
        self.m = manifest
        self.cutter = FrameCutter(manifest)
        self.checksums: dict[int, int] = {}
        self.ring: collections.deque[_Slot] = collections.deque()  # written, not yet answered (FIFO space)
        self.answers: collections.deque[_Slot | str] = collections.deque()  # what each next answer is for
        self.retries: collections.Counter[int] = collections.Counter()
        self.error: TransferError | None = None
        self.committed = False
        self.cond = asyncio.Condition()
        self.commit_answer: asyncio.Future[tuple[Reason, str]] | None = None
        self.raw_bytes = self.wire_bytes = self.retransmits = 0
        self.t_open = time.monotonic()
        self.t_last_send = self.t_open
        self.staging: RegisteredBuffer | None = None
        self.remote: BufferDescriptor | None = None
        self.head = 0  # next free offset in the ring
        self.reader: asyncio.Task[None] | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def start(self) -> None:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(self.s.host, self.s.port), self.s.timeout_s)
        except (OSError, TimeoutError) as exc:
            raise self._fail(Reason.CONNECTION, f"control stream to {self.s.host}:{self.s.port}: {exc}") from exc
        self.writer = w
        w.write(message(MsgType.MANIFEST, manifest_body(self.m)))
        try:
            kind, code, body = await asyncio.wait_for(read_message(r, 1 << 20), self.s.timeout_s)
            ans = parse_answer(kind, code, body)
        except (OSError, TimeoutError, WireError, asyncio.IncompleteReadError) as exc:
            raise self._fail(Reason.CONNECTION, f"no manifest answer: {exc}") from exc
        if ans.reason is not Reason.OK:
            raise self._fail(ans.reason, f"manifest refused: {ans.text}")
        try:
            self.remote = BufferDescriptor.from_json(ans.text)
            self.staging = await asyncio.to_thread(self.s.engine.allocate, self.remote.nbytes)
        except (MooncakeTEError, json.JSONDecodeError) as exc:
            raise self._fail(Reason.CONNECTION, f"cannot set up Mooncake TE staging: {exc}") from exc
        self.reader = asyncio.create_task(self._read_answers(r))

    def _fail(self, reason: Reason, text: str) -> TransferError:
        if self.error is None:
            self.error = TransferError(reason, text, self.m.cache_id)
            if self.commit_answer is not None and not self.commit_answer.done():
                self.commit_answer.set_exception(self.error)
                self.commit_answer.exception()
            asyncio.get_running_loop().create_task(self._notify())
        return self.error

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    # -- sending --------------------------------------------------------------------------
    async def send(self, chunk: LayerKVChunk) -> None:
        if self.error is not None:
            raise self.error
        for piece in self.cutter.cut(chunk):
            frame = encode_piece(self.m, piece) if self.m.codec == "none" else \
                await asyncio.to_thread(encode_piece, self.m, piece)
            self.checksums[frame.seq] = frame.checksum
            self.raw_bytes += frame.raw_len
            self.wire_bytes += frame.payload_len
            await self._place(frame)
        self.t_last_send = time.monotonic()

    async def _reserve(self, length: int) -> int:
        """Offset of `length` free bytes in the ring; waits for answers to free space (backpressure)."""
        assert self.remote is not None
        size = self.remote.nbytes
        if length > size:
            raise self._fail(Reason.OVERSIZED, f"frame of {length} bytes exceeds the receiver's region of {size}")

        def fits() -> int | None:
            # Live slots occupy the ring from the oldest unanswered one (tail) up to head, wrapping.
            if not self.ring:
                return 0
            tail = self.ring[0].offset
            if self.head > tail:  # free: [head, size) and [0, tail)
                if self.head + length <= size:
                    return self.head
                return 0 if length <= tail else None
            return self.head if self.head + length <= tail else None  # free: [head, tail)

        async with self.cond:
            await self.cond.wait_for(lambda: self.error is not None or fits() is not None)
        if self.error is not None:
            raise self.error
        offset = fits()
        assert offset is not None
        self.head = offset + length
        return offset

    async def _place(self, frame: Frame, slot: _Slot | None = None) -> None:
        data = frame.body()
        if slot is None:
            offset = await self._reserve(len(data))
            slot = _Slot(frame, offset, len(data))
            self.ring.append(slot)
        assert self.staging is not None and self.remote is not None and self.writer is not None
        self.staging.array[slot.offset:slot.offset + slot.length] = memoryview(data)
        try:
            await asyncio.to_thread(self.s.engine.write, self.staging, self.remote, slot.length, slot.offset,
                                    slot.offset)
        except MooncakeTEError as exc:
            raise self._fail(Reason.CONNECTION, str(exc)) from exc
        self.answers.append(slot)
        self.writer.write(message(MsgType.FRAME_REF, FRAME_REF.pack(slot.offset, slot.length)))
        await self.writer.drain()

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                kind, code, body = await read_message(reader, 1 << 20)
                ans = parse_answer(kind, code, body)
                what = self.answers.popleft() if self.answers else None
                if what == "commit":
                    if self.commit_answer is not None and not self.commit_answer.done():
                        self.commit_answer.set_result((ans.reason, ans.text))
                    continue
                if not isinstance(what, _Slot):
                    raise WireError(Reason.MALFORMED, f"unsolicited {kind.name}")
                if ans.reason is Reason.OK:
                    what.done = True
                    while self.ring and self.ring[0].done:
                        self.ring.popleft()
                elif ans.reason in FATAL_REASONS:
                    self._fail(ans.reason, f"frame {what.frame.seq} refused: {ans.text}")
                else:
                    self.retries[what.frame.seq] += 1
                    if self.retries[what.frame.seq] > self.s.max_retry:
                        self._fail(ans.reason, f"frame {what.frame.seq} refused {self.retries[what.frame.seq]} "
                                   f"times, last: {ans.text}")
                    else:
                        self.retransmits += 1
                        asyncio.get_running_loop().create_task(self._place(what.frame, what))
                await self._notify()
        except (OSError, asyncio.IncompleteReadError, WireError) as exc:
            if not self.committed:
                self._fail(Reason.CONNECTION, f"control stream lost: {exc}")

    async def commit(self) -> TransferStats:
        if self.error is not None:
            raise self.error
        missing = self.cutter.incomplete()
        if missing:
            raise ChunkError("commit() before all KV was sent: " + "; ".join(missing[:4]))
        assert self.writer is not None
        digest = commit_digest([self.checksums[s] for s in range(self.m.frame_count)])
        for attempt in range(self.s.max_retry + 1):
            async with self.cond:  # retransmissions must be placed before the commit
                await self.cond.wait_for(lambda: self.error is not None or all(s.done for s in self.ring))
            if self.error is not None:
                raise self.error
            self.commit_answer = asyncio.get_running_loop().create_future()
            self.answers.append("commit")
            self.writer.write(message(MsgType.COMMIT, commit_body(self.m.frame_count, digest)))
            try:
                reason, text = await asyncio.wait_for(self.commit_answer, self.s.timeout_s)
            except TimeoutError:
                raise self._fail(Reason.TIMEOUT, "no commit acknowledgement") from None
            if reason is Reason.OK:
                break
            if reason is not Reason.CHECKSUM or attempt == self.s.max_retry:
                raise self._fail(reason, f"commit refused: {text}")
        self.committed = True
        now = time.monotonic()
        await self._close()
        return TransferStats(self.m.cache_id, self.m.frame_count, self.raw_bytes, self.wire_bytes, self.retransmits,
                             0, now - self.t_open, now - self.t_last_send)

    async def abort(self, reason: str) -> None:
        if self.writer is not None and not self.writer.is_closing():
            with contextlib.suppress(Exception):
                self.writer.write(message(MsgType.ABORT, reason.encode()[:1024]))
        self._fail(Reason.ABORTED, reason)
        self.committed = True
        await self._close()

    async def _close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(BaseException):
                await self.reader
        if self.writer is not None:
            self.writer.close()
        if self.staging is not None:
            self.s.engine.unregister(self.staging)
            self.staging = None
