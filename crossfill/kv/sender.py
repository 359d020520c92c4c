"""What every sending backend shares: frames cut, encoded, pinned and committed the same way.

A backend differs only in how a frame and a commit travel (striped TCP streams, one-sided Mooncake
TE writes plus a control stream, objects in a KV store) and in its own retransmit and reconnect
machinery.  Everything else lives here once: cutting a LayerKVChunk into the manifest's frame
slots, encoding (in a worker thread for large frames with a codec that does real work), pinning
the encoded frames until the commit is acknowledged, the commit digest, the `committed` flag, the
abort path and the `TransferStats`.

A backend subclasses `FrameSender` and implements `_ship` (one encoded frame, in seq order as
prefill produces them), `_deliver_commit` (returns once the receiver acknowledged the commit),
`_tell_abort` (best effort) and `_close` (stop tasks, drop connections); optionally `start` (runs
inside `open()`, before the caller's first `send`).  Its `TransferBackend` builds one per
transfer in `_transfer()`; `SenderBackend.open()` runs the transfer under `aborted_unless_committed`.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.backend import OutgoingTransfer, TransferBackend, TransferStats, aborted_unless_committed
from crossfill.kv.chunker import ChunkError, FrameCutter, FramePiece, encode_piece
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.wire import Frame, Manifest, commit_body, commit_digest

# Encode in a worker thread only when the codec does real work on a large frame; a plain copy is
# cheaper inline than a thread hand-off under the interpreter lock.
THREAD_ENCODE_BYTES = 1 << 20

# Refusals that retrying cannot fix: the transfer fails at once with this reason (all backends).
FATAL_REASONS = frozenset({
    Reason.EXPIRED, Reason.ABORTED, Reason.SINK_ERROR, Reason.TIMEOUT, Reason.FINGERPRINT_MISMATCH,
    Reason.TOKEN_DIGEST_MISMATCH, Reason.TENANT_MISMATCH, Reason.MANIFEST_MISMATCH, Reason.DUPLICATE,
    Reason.COMMIT_DIGEST, Reason.UNKNOWN_VERSION, Reason.NO_RESOURCES,
})
# Manifest refusals that may clear up (decode has not registered the cache id yet, or the message
# was damaged in transit): the stream is opened again after a backoff, like a broken one.
RETRY_MANIFEST = frozenset({Reason.UNKNOWN_CACHE_ID, Reason.CHECKSUM, Reason.MALFORMED})


class Retry(Exception):  # noqa: N818 - a signal to reconnect, not an error the caller sees
    """A stream broke or was refused in a way that reconnecting may fix."""

    def __init__(self, reason: Reason, text: str) -> None:
        super().__init__(text)
        self.reason = reason
        self.text = text


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


async def encode_frame(manifest: Manifest, piece: FramePiece) -> Frame:
    """Encode one frame-slot piece; large frames with a working codec go to a worker thread."""
    if manifest.codec != "none" and piece.k.numel() * piece.k.element_size() * 2 >= THREAD_ENCODE_BYTES:
        return await asyncio.to_thread(encode_piece, manifest, piece)
    return encode_piece(manifest, piece)


class FrameSender(OutgoingTransfer):
    """One outgoing transfer: the shared half (see the module docstring)."""

    pin_frames = True  # keep encoded frames until the commit is acknowledged (False: checksums only)

    def __init__(self, manifest: Manifest) -> None:
        self.m = manifest
        self.cutter = FrameCutter(manifest)
        self.frames: dict[int, Frame] = {}  # pinned until the commit is acknowledged
        self.checksums: dict[int, int] = {}
        self.retries: collections.Counter[int] = collections.Counter()  # refusals per frame
        self.error: TransferError | None = None
        self.committed = False
        self.closed = False
        self.raw_bytes = self.wire_bytes = self.retransmits = self.reconnects = 0
        self.t_open = self.t_last_send = time.monotonic()

    # -- what a backend implements --------------------------------------------------------
    async def start(self) -> None:  # noqa: B027 - optional: most backends start lazily
        """Called inside `open()` before the caller's first send; may raise to refuse the transfer."""

    @abc.abstractmethod
    async def _ship(self, frame: Frame) -> None:
        """Queue or put one encoded frame on its way (it is already pinned and counted)."""

    @abc.abstractmethod
    async def _deliver_commit(self, body: bytes) -> None:
        """Send the COMMIT body and return once the receiver acknowledged it; raise TransferError otherwise."""

    @abc.abstractmethod
    async def _tell_abort(self, reason: str) -> None:
        """Tell the receiver the transfer is abandoned (best effort)."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Stop the backend's tasks and connections; the base then unpins the frames."""

    def _streams(self) -> int:
        return 1

    # -- shared ---------------------------------------------------------------------------
    def _fail(self, reason: Reason, text: str) -> TransferError:
        """Record the transfer's first failure; returns it (to raise)."""
        if self.error is None:
            self.error = TransferError(reason, text, self.m.cache_id)
        return self.error

    def _resend_allowed(self, seq: int, reason: Reason, text: str, max_retry: int) -> bool:
        """Count a refusal of frame `seq`: True to resend it, False when it failed the transfer."""
        failure = refused_frame_failure(self.retries, seq, reason, text, max_retry)
        if failure is not None:
            self._fail(*failure)
            return False
        self.retransmits += 1
        return True

    @staticmethod
    def reconnect_delay(failures: int) -> float:
        """Backoff before reconnection number `failures` (1, 2, ...): 50 ms doubling, at most 1 s."""
        return min(1.0, 0.05 * 2 ** (failures - 1))

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    async def send(self, chunk: LayerKVChunk) -> None:
        self._raise_if_failed()
        if self.committed or self.closed:
            raise RuntimeError("send() after commit() or abort()")
        for piece in self.cutter.cut(chunk):
            frame = await encode_frame(self.m, piece)
            self._raise_if_failed()
            if self.pin_frames:
                self.frames[frame.seq] = frame
            self.checksums[frame.seq] = frame.checksum
            self.raw_bytes += frame.raw_len
            self.wire_bytes += frame.payload_len
            await self._ship(frame)
            # Let the backend's tasks write this frame (and read answers) before encoding the
            # next: encoding and sending overlap even when the caller sends a whole cache at once.
            await asyncio.sleep(0)
        self.t_last_send = time.monotonic()

    async def commit(self) -> TransferStats:
        self._raise_if_failed()
        missing_layers = self.cutter.incomplete()
        if missing_layers:
            raise ChunkError("commit() before all KV was sent: " + "; ".join(missing_layers[:4]))
        digest = commit_digest([self.checksums[s] for s in range(self.m.frame_count)])
        await self._deliver_commit(commit_body(self.m.frame_count, digest))
        self.committed = True
        now = time.monotonic()
        stats = TransferStats(
            cache_id=self.m.cache_id, frames=self.m.frame_count, raw_bytes=self.raw_bytes,
            wire_bytes=self.wire_bytes, retransmits=self.retransmits, reconnects=self.reconnects,
            duration_s=now - self.t_open, commit_wait_s=now - self.t_last_send, streams=self._streams(),
        )
        await self.release()
        return stats

    async def abort(self, reason: str) -> None:
        if self.closed:
            return
        await self._tell_abort(reason)
        self._fail(Reason.ABORTED, reason)
        await self.release()

    async def release(self) -> None:
        """End the transfer locally: backend tasks stop and the pinned frames are let go."""
        self.closed = True
        await self._close()
        self.frames.clear()


class SenderBackend(TransferBackend):
    """A TransferBackend whose transfers are FrameSenders: `open()` is the same for all of them.

    `timeout_ms` bounds each wait of a transfer; `max_retry` bounds its retries (per frame, per
    object, reconnections in a row: the backend says which).
    """

    def __init__(self, timeout_ms: float, max_retry: int) -> None:
        if timeout_ms <= 0 or max_retry < 0:
            raise ValueError(f"timeout_ms must be > 0 and max_retry >= 0, got {timeout_ms} and {max_retry}")
        self.timeout_s = timeout_ms / 1000
        self.max_retry = max_retry

    @abc.abstractmethod
    def _transfer(self, manifest: Manifest) -> FrameSender:
        """A new transfer of `manifest` to this backend's destination."""

    @contextlib.asynccontextmanager
    async def _opened(self, manifest: Manifest) -> AsyncIterator[OutgoingTransfer]:
        tx = self._transfer(manifest)
        async with aborted_unless_committed(tx):
            await tx.start()
            yield tx

    def open(self, manifest: Manifest) -> contextlib.AbstractAsyncContextManager[OutgoingTransfer]:
        return self._opened(manifest)


__all__ = ["FATAL_REASONS", "FrameSender", "Retry", "SenderBackend", "THREAD_ENCODE_BYTES", "encode_frame",
           "parse_endpoint", "refused_frame_failure"]
