"""Transfer backend over Mooncake Transfer Engine (TE): bulk bytes one-sided, control over a small TCP stream.

TE writes straight into memory the receiver registered, but says nothing to the receiver.  So a
transfer keeps the built-in protocol for control (manifest, per-frame notices and answers,
commit; same checks, reasons and counters as the TCP backend) and only the frame bytes move by TE:

1. the sender sends the MANIFEST on a control stream; the receiver accepts it, registers a
   staging region for the transfer (once: a sender that reconnects gets the same region back) and
   answers with its TE buffer descriptor;
2. per frame, the sender copies the encoded frame into its own registered staging buffer at an
   offset of a ring and TE-writes it to the same offset of the receiver's region.  Up to
   `MAX_WRITES` writes are in flight at once, submitted without blocking and polled from the
   event loop; frames queued next to each other in the ring share one write (up to
   `COALESCE_BYTES`).  Once a write has landed, the sender sends one FRAME_REF (offset, length)
   per frame on the control stream;
3. the receiver copies the frame out of its region, verifies and decodes it exactly like an inline
   frame, hands it to the sink and answers; an answered frame frees its ring space; refused
   frames are written again up to max_retry times;
4. COMMIT as soon as every frame has its FRAME_REF on the stream: the receiver handles a stream's
   messages in order, so it sees the commit after the frames, one round trip earlier than waiting
   for every answer.  The sender keeps the encoded frames until the commit is acknowledged.

A broken control stream, or one that owes answers for timeout_ms, is reconnected (short
backoff; max_retry times in a row without an answer in between): the sender sends the manifest
again, gets the same region back, sends FRAME_REFs again for every frame not yet answered (their
bytes are still in the region, since only an answer frees ring space) and then the commit if it
was in flight.  A frame the receiver had already accepted is acknowledged again without reaching
the sink twice; if the receiver already completed the transfer (the commit's answer was lost), its
manifest answer says so and the sender takes that as the acknowledgement.  TE writes go on while
the control stream is down.

Limits: one control stream per transfer, and the receiver handles its frames one at a time; every
frame is copied into the sender's staging (TE reads registered memory only) and out of the
receiver's region.  A TE write that fails is retried up to max_retry times, but TE writes that
make no progress for timeout_ms fail the transfer with `connection` (the caller's fallback
applies), as does a receiver that cannot be reached again within max_retry reconnections.  A
failed transfer's staging buffer stays registered until its writes in flight have finished (for
good, logged, if TE reports one timed out, since TE may still read it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from crossfill.kv.assembler import Assembly
from crossfill.kv.control import ControlServer, FramePath
from crossfill.kv.errors import Reason, TransferError, WireError
from crossfill.kv.mooncake_te import (
    BufferDescriptor,
    MooncakeTEError,
    MooncakeTransferEngine,
    PendingWrite,
    RegisteredBuffer,
)
from crossfill.kv.sender import RETRY_MANIFEST, FrameSender, Retry, SenderBackend, parse_endpoint
from crossfill.kv.wire import (
    Frame,
    Manifest,
    MsgType,
    answer,
    manifest_body,
    max_frame_body,
    message,
    parse_answer,
    read_message,
)

log = logging.getLogger(__name__)

FRAME_REF = struct.Struct("!QI")
DEFAULT_REGION_BYTES = 64 << 20
# TE writes in flight per transfer.  Over TE's TCP transport on loopback, one 1 MiB write at a time
# reaches about half of what 4-8 concurrent ones do; more than 8 gained nothing.
MAX_WRITES = 8
# Frames queued next to each other in the ring go in one TE write up to this size: fewer batches
# to submit and poll when frames are small, while ~1 MiB frames still spread over several writes.
COALESCE_BYTES = 4 << 20
# Pause between polls of the writes in flight: it doubles from the first value up to the second
# while none finishes and drops back when one does.  Polling without a pause starved TE's own
# threads on a 2-core host (half the rate); starting at 1 ms cost about a third.  The event loop
# rounds an idle wait up to 1 ms, but answers arriving on the control stream wake it sooner; a
# worker thread polling every 100 us measured no better on loopback, so the loop does it.
_POLL_MIN_S, _POLL_MAX_S = 0.0001, 0.002
# How long a failed transfer's staging buffer is kept for TE writes still in flight to finish.
_RELEASE_WAIT_S = 60.0


# =============================================================================================
# receiver
# =============================================================================================

class TEFrames(FramePath):
    """The control server's frame path for TE: a registered region per transfer, frames by reference."""

    def __init__(self, engine: MooncakeTransferEngine, region_bytes: int = DEFAULT_REGION_BYTES) -> None:
        self.engine = engine
        self.region_bytes = region_bytes
        self.regions: dict[str, RegisteredBuffer] = {}

    def accepted_text(self, a: Assembly) -> str:
        region = self.regions.get(a.cache_id)
        if region is None:
            if a.finished:
                # Its commit was accepted and the region released: a sender that lost the commit's
                # answer and reconnected learns the outcome, and no region is registered again.
                return json.dumps({"complete": True})
            assert a.manifest is not None
            size = max(max_frame_body(a.manifest), min(self.region_bytes, _total_bound(a.manifest)))
            try:
                region = self.regions[a.cache_id] = self.engine.allocate(size)
            except (MooncakeTEError, MemoryError) as exc:
                raise WireError(Reason.NO_RESOURCES, f"cannot register a {size}-byte TE staging region "
                                f"for this transfer: {exc}") from exc
        return self.engine.describe(region).to_json()

    async def frame_ref(self, server: ControlServer, bound: Assembly | None, body: bytes) -> bytes:
        if bound is None:
            return server.refuse(MsgType.FRAME_ACK, Reason.UNKNOWN_CACHE_ID, "frame on a stream with no accepted manifest")
        region = self.regions.get(bound.cache_id)
        if region is None and bound.finished:  # the region went with the transfer
            failure = bound.done.exception()
            if failure is None:
                # A reconnected sender repeating a FRAME_REF whose answer it lost, after its
                # commit completed the transfer: that frame was accepted.
                return answer(MsgType.FRAME_ACK, Reason.OK, 0, "transfer already complete")
            return server.refuse(MsgType.FRAME_ACK, Reason.ABORTED, f"transfer already failed: {failure}")
        if len(body) != FRAME_REF.size or region is None:
            return server.refuse(MsgType.FRAME_ACK, Reason.MALFORMED, "bad FRAME_REF")
        offset, length = FRAME_REF.unpack(body)
        if offset + length > region.nbytes:
            return server.refuse(MsgType.FRAME_ACK, Reason.OVERSIZED,
                                 f"frame at [{offset}, {offset + length}) outside the {region.nbytes}-byte region")
        # An owned, writable copy: the checksum and the decoder see the same bytes even if the
        # region is written again, and the decoder may build the sink's tensors over it in place.
        data = bytearray(region.array[offset:offset + length])
        return await server.on_frame(bound, data)

    def released(self, cache_id: str) -> None:
        region = self.regions.pop(cache_id, None)
        if region is not None:
            self.engine.unregister(region)

    def close(self) -> None:
        for cache_id in list(self.regions):
            self.released(cache_id)


class TEReceiver(ControlServer):
    """The shared control server with frames arriving by Mooncake TE into a per-transfer region."""

    name = "mooncake_te"

    def __init__(self, engine: MooncakeTransferEngine, host: str = "127.0.0.1", port: int = 0, *,
                 region_bytes: int = DEFAULT_REGION_BYTES, tls: ssl.SSLContext | None = None,
                 timeout_ms: int = 8000, keep_finished: int = 1024) -> None:
        super().__init__(host, port, frames=TEFrames(engine, region_bytes), tls=tls, timeout_ms=timeout_ms,
                         keep_finished=keep_finished)
        self.engine = engine


def _total_bound(m: Manifest) -> int:
    return m.frame_count * max_frame_body(m)


# =============================================================================================
# sender
# =============================================================================================

class TESender(SenderBackend):
    """Sends transfers to a TEReceiver: control to `endpoint`, bytes by `engine`.

    `timeout_ms` bounds each wait (connecting, an answer owed, TE writes making progress);
    `max_retry` bounds refusals per frame, failed writes per frame and reconnections in a row.
    """

    name = "mooncake_te"

    def __init__(self, endpoint: str | tuple[str, int], engine: MooncakeTransferEngine, *,
                 timeout_ms: int = 8000, max_retry: int = 2) -> None:
        super().__init__(timeout_ms, max_retry)
        self.host, self.port = parse_endpoint(endpoint)
        self.engine = engine

    def _transfer(self, manifest: Manifest) -> FrameSender:
        return _TETransfer(self, manifest)


@dataclass(eq=False)
class _Slot:
    """One frame's place in the ring, in the sender's staging and the receiver's region alike."""

    frame: Frame
    offset: int
    length: int
    # staged (needs a TE write) -> writing -> written (needs a FRAME_REF) -> referenced -> done
    state: str = "staged"
    write_failures: int = 0


@dataclass(eq=False)
class _Write:
    """One TE write in flight, covering slots that lie next to each other in the ring."""

    pending: PendingWrite
    slots: list[_Slot]
    remote: BufferDescriptor  # the region it lands in (a reconnect may hand out another)


class _TETransfer(FrameSender):
    def __init__(self, sender: TESender, manifest: Manifest) -> None:
        super().__init__(manifest)
        self.s = sender
        # Ring space is held from the oldest unanswered slot (ring[0]) up to `head`, wrapping.
        self.ring: collections.deque[_Slot] = collections.deque()
        self.head = 0
        self.to_write: collections.deque[_Slot] = collections.deque()
        self.writes: list[_Write] = []
        self.to_ref: collections.deque[_Slot] = collections.deque()  # written, FRAME_REF not on this stream
        self.answers: collections.deque[_Slot | str] = collections.deque()  # what the stream's next answers are for
        self.commit_msg = b""
        self.commit_state: str | None = None  # "due": to send on the current stream; "sent": answer owed
        self.commit_answer: asyncio.Future[tuple[Reason, str, tuple[int, ...]]] | None = None
        self.staging: RegisteredBuffer | None = None
        self.remote: BufferDescriptor | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.failures = 0  # stream breaks and failed reconnections since the last answer
        self.changed = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.poller: asyncio.Task[None] | None = None
        now = self.t_open
        self.last_answer = now  # answers owed on the stream are owed since then
        self.last_write = now  # a TE write last finished then (or the first of a busy spell was submitted)
        self.last_progress = now
        # No answer, write or handshake for this long means something hangs that no other
        # deadline caught: the longest a run of reconnections (connect + manifest answer + backoff
        # each) may take.
        self.stall_s = (sender.max_retry + 1) * (2 * sender.timeout_s + 1.0)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        for coro in (self._keep_stream(), self._watchdog()):
            task = asyncio.create_task(coro)
            task.add_done_callback(self._task_done)
            self.tasks.append(task)
        await self._wait(lambda: self.staging is not None, "the receiver's manifest answer")

    def _task_done(self, task: asyncio.Task[None]) -> None:
        """A background task that died of a bug fails the transfer instead of leaving it to hang."""
        if not task.cancelled() and task.exception() is not None:
            self._fail(Reason.CONNECTION, f"internal error in the TE sender: {task.exception()!r}")

    def _fail(self, reason: Reason, text: str) -> TransferError:
        if self.error is None:
            super()._fail(reason, text)
            assert self.error is not None
            if self.commit_answer is not None and not self.commit_answer.done():
                self.commit_answer.set_exception(self.error)
                self.commit_answer.exception()
            self.changed.set()
        return self.error

    async def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until `ready()`, raising the transfer's error; fails it if nothing progresses for stall_s."""
        while True:
            if self.error is not None:
                raise self.error
            if ready():
                return
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), self.s.timeout_s)
            except TimeoutError:
                if time.monotonic() - self.last_progress > self.stall_s:
                    raise self._fail(Reason.TIMEOUT, f"no progress towards {what} for {self.stall_s:.1f} s") from None

    async def _tell_abort(self, reason: str) -> None:
        if self.writer is not None and not self.writer.is_closing():
            with contextlib.suppress(Exception):
                self.writer.write(message(MsgType.ABORT, reason.encode()[:1024]))

    async def _close(self) -> None:
        tasks = [t for t in (*self.tasks, self.poller) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.ring.clear()
        self.to_write.clear()
        self.to_ref.clear()
        self._release_staging()

    def _release_staging(self) -> None:
        staging, pending = self.staging, [w.pending for w in self.writes]
        self.staging, self.writes = None, []
        if staging is None:
            return
        if all(p.finished for p in pending):
            self.s.engine.unregister(staging)
            return
        # TE may still read the staging for writes in flight: release it once they have finished.
        task = asyncio.get_running_loop().create_task(_release_later(self.s.engine, staging, pending))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    # -- sending --------------------------------------------------------------------------
    async def _ship(self, frame: Frame) -> None:
        await self._stage(frame)
        # The base yields after this: the poller reaps finished writes (and sends their
        # FRAME_REFs) between frames, so a large chunk does not leave TE idle once MAX_WRITES are
        # in flight.
        self._kick()

    async def _stage(self, frame: Frame) -> None:
        """Copy a frame into free ring space of the staging buffer and queue its TE write."""
        header = frame.header()
        length = len(header) + frame.payload_len
        offset = await self._reserve(length)
        assert self.staging is not None
        at = offset
        for part in (header, *frame.parts):  # straight into staging: no joined temporary copy
            src = np.frombuffer(part, dtype=np.uint8)
            self.staging.array[at:at + src.size] = src
            at += src.size
        slot = _Slot(frame, offset, length)
        self.ring.append(slot)
        self.to_write.append(slot)

    def _fits(self, length: int) -> int | None:
        """Offset of `length` free bytes in the ring, or None while answers have not freed enough."""
        assert self.remote is not None
        size = self.remote.nbytes
        if not self.ring:
            return 0
        tail = self.ring[0].offset
        if self.head > tail:  # free: [head, size) and [0, tail)
            if self.head + length <= size:
                return self.head
            return 0 if length <= tail else None
        return self.head if self.head + length <= tail else None  # free: [head, tail)

    async def _reserve(self, length: int) -> int:
        """Offset of `length` free bytes in the ring; waits for answers to free space (backpressure)."""
        assert self.remote is not None
        if length > self.remote.nbytes:
            raise self._fail(Reason.OVERSIZED,
                             f"frame of {length} bytes exceeds the receiver's region of {self.remote.nbytes}")
        if self._fits(length) is None:
            self._kick()  # what is staged must go out, or no answer will free space
            await self._wait(lambda: self._fits(length) is not None, "free ring space")
        offset = self._fits(length)
        assert offset is not None
        self.head = offset + length
        return offset

    def _kick(self) -> None:
        """Move the transfer on: submit staged writes, then send the FRAME_REFs and commit that are due."""
        if self.error is not None or self.closed:
            return
        self._submit_writes()
        if self.writer is not None and not self.writer.is_closing():
            self._send_refs()
            self._send_commit()
        if self.writes and self.poller is None:
            self.poller = asyncio.get_running_loop().create_task(self._poll_writes())
            self.poller.add_done_callback(self._task_done)

    def _submit_writes(self) -> None:
        assert self.staging is not None and self.remote is not None
        while self.to_write and len(self.writes) < MAX_WRITES and self.error is None:
            run = [self.to_write.popleft()]
            size = run[0].length
            while (self.to_write and self.to_write[0].offset == run[-1].offset + run[-1].length
                   and size + self.to_write[0].length <= COALESCE_BYTES):
                run.append(self.to_write.popleft())
                size += run[-1].length
            try:
                pending = self.s.engine.submit_write(self.staging, self.remote, size, run[0].offset, run[0].offset)
            except MooncakeTEError as exc:
                self._write_failed(run, exc)
                continue
            for slot in run:
                slot.state = "writing"
            if not self.writes:
                self.last_write = time.monotonic()  # a busy spell starts: progress is measured from here
            self.writes.append(_Write(pending, run, self.remote))

    def _write_failed(self, run: list[_Slot], exc: MooncakeTEError) -> None:
        """Queue a failed write's frames again (first, they are the oldest), within max_retry each."""
        for slot in run:
            slot.write_failures += 1
            if slot.write_failures > self.s.max_retry:
                self._fail(Reason.CONNECTION, f"frame {slot.frame.seq}: {exc} (gave up after {self.s.max_retry} "
                           "retries)")
                return
        self.retransmits += len(run)
        for slot in reversed(run):
            slot.state = "staged"
            self.to_write.appendleft(slot)

    async def _poll_writes(self) -> None:
        """Runs while TE writes are in flight: finished ones get their FRAME_REFs sent."""
        pause = _POLL_MIN_S
        try:
            while self.writes and self.error is None and not self.closed:
                await asyncio.sleep(pause)
                if self._reap_writes():
                    pause = _POLL_MIN_S
                    self.last_write = self.last_progress = time.monotonic()
                    self.changed.set()
                else:
                    pause = min(_POLL_MAX_S, pause * 2)
                    if self.writes and time.monotonic() - self.last_write > self.s.timeout_s:
                        self._fail(Reason.CONNECTION, f"Mooncake TE writes to {self.writes[0].pending.peer} made no "
                                   f"progress for {self.s.timeout_s * 1000:.0f} ms")
                self._kick()
        finally:
            self.poller = None

    def _reap_writes(self) -> int:
        """Collect the writes that finished; return how many did."""
        still: list[_Write] = []
        failed: list[tuple[_Write, MooncakeTEError]] = []
        for w in self.writes:
            try:
                if not w.pending.poll():
                    still.append(w)
                    continue
            except MooncakeTEError as exc:
                failed.append((w, exc))
                continue
            for slot in w.slots:
                if slot.state != "writing":
                    continue  # the receiver reported the transfer complete meanwhile
                if w.remote == self.remote:
                    slot.state = "written"
                    self.to_ref.append(slot)
                else:  # it landed in a region the receiver no longer uses
                    slot.state = "staged"
                    self.to_write.append(slot)
        finished = len(self.writes) - len(still)
        self.writes = still
        for w, exc in failed:
            self._write_failed([s for s in w.slots if s.state == "writing"], exc)
        return finished

    def _send_refs(self) -> None:
        assert self.writer is not None
        if not self.answers:
            self.last_answer = time.monotonic()  # answers are owed from now on
        out: list[bytes] = []
        while self.to_ref:
            slot = self.to_ref.popleft()
            if slot.state == "written":
                slot.state = "referenced"
                self.answers.append(slot)
                out.append(message(MsgType.FRAME_REF, FRAME_REF.pack(slot.offset, slot.length)))
        if out:
            self.writer.write(b"".join(out))

    def _send_commit(self) -> None:
        """Send the commit once every frame not yet answered has its FRAME_REF on this stream."""
        assert self.writer is not None
        if self.commit_state != "due" or self.to_write or self.writes or self.to_ref:
            return
        if not self.answers:
            self.last_answer = time.monotonic()
        self.commit_state = "sent"
        self.answers.append("commit")
        self.writer.write(self.commit_msg)

    async def _deliver_commit(self, body: bytes) -> None:
        self.commit_msg = message(MsgType.COMMIT, body)
        for attempt in range(self.s.max_retry + 1):
            fut = self.commit_answer = asyncio.get_running_loop().create_future()
            self.commit_state = "due"
            self._kick()
            await self._wait(fut.done, "the commit's acknowledgement")
            reason, text, missing_seqs = fut.result()
            if reason is Reason.OK:
                break
            if reason not in (Reason.INCOMPLETE, Reason.CHECKSUM) or attempt == self.s.max_retry:
                raise self._fail(reason, f"commit refused: {text}")
            await self._stage_missing(missing_seqs)

    async def _stage_missing(self, seqs: tuple[int, ...]) -> None:
        """Stage again the frames the receiver reports missing that are not already on their way."""
        on_the_way = {s.frame.seq for s in self.ring if s.state != "done"}
        for seq in seqs:
            if seq not in on_the_way and seq in self.frames:
                self.retransmits += 1
                await self._stage(self.frames[seq])
                self._kick()

    # -- the control stream ---------------------------------------------------------------
    async def _keep_stream(self) -> None:
        """Own the control stream: open it, read its answers, and open it again after a break."""
        while self.error is None and not self.closed:
            try:
                reader = await self._handshake()
                await self._read_answers(reader)
            except TransferError:
                return  # fatal: _fail has recorded it
            except Retry as exc:
                last = exc
            except (OSError, TimeoutError, EOFError, WireError) as exc:
                last = Retry(Reason.CONNECTION, f"control stream lost: {type(exc).__name__}: {exc}")
            self._drop_stream()
            if self.error is not None or self.closed:
                return
            self.failures += 1
            if self.failures > self.s.max_retry:
                self._fail(last.reason, f"{self.s.host}:{self.s.port}: {last.text} (gave up after "
                           f"{self.s.max_retry} retries)")
                return
            self.reconnects += 1
            await asyncio.sleep(self.reconnect_delay(self.failures))

    async def _handshake(self) -> asyncio.StreamReader:
        """Connect, send the manifest and take the receiver's region from its answer."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.s.host, self.s.port),
                                                    self.s.timeout_s)
        except (OSError, TimeoutError) as exc:
            raise Retry(Reason.CONNECTION, f"cannot open the control stream: {type(exc).__name__}: {exc}") from exc
        try:
            writer.write(message(MsgType.MANIFEST, manifest_body(self.m)))
            try:
                kind, code, body = await asyncio.wait_for(read_message(reader, 1 << 20), self.s.timeout_s)
                ans = parse_answer(kind, code, body)
            except (OSError, TimeoutError, EOFError, WireError) as exc:
                raise Retry(Reason.CONNECTION, f"no manifest answer: {type(exc).__name__}: {exc}") from exc
            if ans.reason in RETRY_MANIFEST:  # e.g. decode has not registered the cache id yet
                raise Retry(ans.reason, f"manifest refused: {ans.text}")
            if ans.reason is not Reason.OK:
                raise self._fail(ans.reason, f"manifest refused: {ans.text}")
            await self._adopt(ans.text)
        except BaseException:
            writer.transport.abort()
            raise
        self.writer = writer
        self.last_answer = self.last_progress = time.monotonic()
        self._kick()  # FRAME_REFs not yet answered and the commit, if due, go out again
        self.changed.set()
        return reader

    async def _adopt(self, text: str) -> None:
        """Take the receiver's region (first stream) or check that a reconnect got the same one."""
        try:
            if json.loads(text or "null") == {"complete": True}:
                self._receiver_completed()
                return
            remote = BufferDescriptor.from_json(text)
        except (ValueError, MooncakeTEError) as exc:
            raise self._fail(Reason.CONNECTION, f"the receiver gave no Mooncake TE region ({exc}); "
                             "is it a TEReceiver?") from exc
        if self.remote is None:
            try:
                staging = self.s.engine.allocate(remote.nbytes)
            except MooncakeTEError as exc:
                raise self._fail(Reason.CONNECTION, f"cannot set up Mooncake TE staging: {exc}") from exc
            self.staging, self.remote = staging, remote
            return
        if remote == self.remote:
            return  # the frames' bytes are still there
        if remote.nbytes != self.remote.nbytes:
            raise self._fail(Reason.CONNECTION, f"the receiver's region changed from {self.remote.nbytes} to "
                             f"{remote.nbytes} bytes on a reconnect")
        # Another region of the same size: every frame not yet answered is written into it again.
        self.remote = remote
        for slot in self.ring:
            if slot.state == "written":
                slot.state = "staged"
        self.to_ref.clear()
        self.to_write = collections.deque(s for s in self.ring if s.state == "staged")

    def _receiver_completed(self) -> None:
        """The receiver verified our commit but its answer was lost with the old stream."""
        if self.commit_answer is None or self.commit_answer.done():
            raise self._fail(Reason.DUPLICATE, "the receiver already completed a transfer with this cache id")
        for slot in self.ring:
            slot.state = "done"
        self.ring.clear()
        self.to_write.clear()
        self.to_ref.clear()
        self.commit_state = None
        self.commit_answer.set_result((Reason.OK, "completed before the control stream broke", ()))

    def _drop_stream(self) -> None:
        """Forget a broken stream: what it owed answers for goes out again on the next one."""
        if self.writer is not None:
            self.writer.transport.abort()
            self.writer = None
        self.answers.clear()
        for slot in self.ring:
            if slot.state == "referenced":
                slot.state = "written"
        self.to_ref = collections.deque(s for s in self.ring if s.state == "written")
        if self.commit_state == "sent":
            self.commit_state = "due"

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        while True:
            kind, code, body = await read_message(reader, 1 << 20)
            ans = parse_answer(kind, code, body)
            if not self.answers:
                raise WireError(Reason.MALFORMED, f"unsolicited {kind.name}: {ans.text}")
            what = self.answers.popleft()
            self.last_answer = self.last_progress = time.monotonic()
            self.failures = 0  # the stream works: reconnections are counted afresh
            if isinstance(what, _Slot):
                self._on_frame_answer(what, ans.reason, ans.text)
            else:
                self.commit_state = None
                if self.commit_answer is not None and not self.commit_answer.done():
                    self.commit_answer.set_result((ans.reason, ans.text, ans.missing))
            self._kick()
            self.changed.set()

    def _on_frame_answer(self, slot: _Slot, reason: Reason, text: str) -> None:
        seq = slot.frame.seq
        if reason is Reason.OK:
            slot.state = "done"
            while self.ring and self.ring[0].state == "done":
                self.ring.popleft()
            return
        if not self._resend_allowed(seq, reason, text, self.s.max_retry):
            return
        # Write it again from staging (its ring space is still held) and reference it again.
        slot.state = "staged"
        self.to_write.appendleft(slot)

    async def _watchdog(self) -> None:
        """Drop a control stream that owes answers for timeout_ms without giving one: it reconnects."""
        period = min(0.25, self.s.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            if (self.writer is not None and self.answers
                    and time.monotonic() - self.last_answer > self.s.timeout_s):
                self.writer.transport.abort()


# Tasks releasing staging buffers of finished transfers (a strong reference keeps them running).
_BACKGROUND: set[asyncio.Task[None]] = set()
# Staging buffers TE may still be reading for writes it timed out on: never freed (rare; logged).
_STRANDED: list[RegisteredBuffer] = []


async def _release_later(engine: MooncakeTransferEngine, staging: RegisteredBuffer,
                         pending: list[PendingWrite]) -> None:
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while time.monotonic() < deadline:
        for p in pending:
            with contextlib.suppress(MooncakeTEError):
                p.poll()
        if all(p.finished for p in pending):
            break
        await asyncio.sleep(0.01)
    if all(p.finished and not p.timed_out for p in pending):
        engine.unregister(staging)
        return
    log.warning("Mooncake TE writes did not finish within %.0f s: keeping their %d-byte staging buffer registered",
                _RELEASE_WAIT_S, staging.nbytes)
    _STRANDED.append(staging)


__all__ = ["TEReceiver", "TESender"]
