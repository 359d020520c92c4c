"""Receiver-side verification of one transfer, shared by every backend.

An `Assembly` is created when the decode side *expects* a cache id.  It checks the manifest
against what decode knows (model fingerprint, prompt digest, tenant, expiry), then each frame
against the manifest (slot, sizes, codec, checksum), decodes it, and only then hands the chunk to
the sink.  The transfer is complete only when a commit whose digest matches every accepted frame
arrives; until then `wait()` has not returned, so decode never runs on partial KV, and on any
failure the consumer gets a TransferError telling it to discard what the sink received.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.codecs import decode_kv
from crossfill.kv.errors import CodecError, Reason, TransferError, WireError
from crossfill.kv.wire import Frame, Manifest, check_frame, commit_digest

Sink = Callable[[LayerKVChunk], Awaitable[None] | None]

# Frames at least this large, with a codec that does real work, are decoded in a worker thread so
# the event loop keeps serving acks; a plain copy is cheaper inline than a thread hand-off.
_THREAD_DECODE_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 8.0


class Counters:
    """Plain counters of accepted and refused work, keyed `refused_<reason>` etc. (metrics come later)."""

    def __init__(self) -> None:
        self._c: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        self._c[name] += n

    def refuse(self, reason: Reason) -> None:
        self._c[f"refused_{reason.label}"] += 1

    def as_dict(self) -> dict[str, int]:
        return dict(self._c)


@dataclass
class Expectation:
    """What the decode side knows about a transfer it is waiting for.

    `fingerprint`, `token_digest`, `tenant` and `manifest` are each checked when given; the decode
    worker normally knows the first three (its own model, the request's prompt and tenant).
    `timeout_s` bounds the silence between messages (None: the receiver's `timeout_ms`);
    `deadline` (time.monotonic seconds) bounds the whole transfer. `authorize` is the permission
    check (decode's transfer-ticket check): called with the first manifest before anything else
    is looked at, it raises WireError(Reason.TICKET) to refuse it.
    """

    cache_id: str
    sink: Sink
    fingerprint: str | None = None
    token_digest: str | None = None
    tenant: str | None = None
    manifest: Manifest | None = None
    timeout_s: float | None = None
    deadline: float | None = None
    authorize: Callable[[Manifest], None] | None = None


@dataclass
class Assembly:
    """The receiving state of one expected transfer."""

    expect: Expectation
    counters: Counters
    manifest: Manifest | None = None
    checksums: dict[int, int] = field(default_factory=dict)
    refused_seqs: set[int] = field(default_factory=set)  # refused frames not accepted since
    inflight: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    raw_bytes: int = 0
    wire_bytes: int = 0
    started: float = field(default_factory=lambda: time.monotonic())  # looked up per call: a test clock applies
    last_activity: float = field(default_factory=lambda: time.monotonic())
    done: asyncio.Future[Manifest] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.expect.timeout_s is None:  # made without a receiver's TransferTable: its default
            self.expect = dataclasses.replace(self.expect, timeout_s=DEFAULT_TIMEOUT_S)

    @property
    def cache_id(self) -> str:
        return self.expect.cache_id

    @property
    def finished(self) -> bool:
        return self.done.done()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # -- failure --------------------------------------------------------------------------
    def fail(self, reason: Reason, message: str) -> None:
        """Fail the transfer once; the waiter raises TransferError and must discard the KV."""
        if not self.done.done():
            self.counters.add(f"transfers_failed_{reason.label}")
            self.done.set_exception(TransferError(reason, message, self.cache_id))
            self.done.exception()  # mark retrieved: a failure nobody waits for is not an asyncio error

    def check_time(self) -> None:
        """Fail on a passed deadline; called by the watchdog and before every write."""
        now = time.monotonic()
        if self.expect.deadline is not None and now >= self.expect.deadline:
            self.fail(Reason.TIMEOUT, "the transfer's deadline passed before its commit")
        elif now - self.last_activity >= self.expect.timeout_s:
            what = "manifest" if self.manifest is None else "next frame or commit"
            self.fail(Reason.TIMEOUT, f"no {what} within {self.expect.timeout_s * 1000:.0f} ms")
        elif self.manifest is not None and self.manifest.is_expired():
            self.fail(Reason.EXPIRED, "the manifest's expiry time passed before the commit")

    def _refuse(self, reason: Reason, message: str) -> WireError:
        self.counters.refuse(reason)
        return WireError(reason, message)

    def _guard(self) -> None:
        if self.done.done():
            if self.done.exception() is not None:
                raise self._refuse(Reason.ABORTED, "transfer already failed: " + str(self.done.exception()))
        self.check_time()
        if self.done.done() and self.done.exception() is not None:
            raise self._refuse(Reason(self.done.exception().reason), str(self.done.exception()))

    # -- manifest -------------------------------------------------------------------------
    def accept_manifest(self, m: Manifest) -> None:
        """Accept the manifest (again, on every connection) or raise WireError with the reason."""
        self._guard()
        if self.manifest is None and self.expect.authorize is not None:
            try:
                self.expect.authorize(m)
            except WireError as exc:
                # Not final, and before touch(): a peer without permission can neither fail the
                # transfer it names nor keep it alive; the permitted sender is still awaited.
                raise self._refuse(exc.reason, exc.message) from None
        self.touch()
        if self.manifest is not None:
            if m != self.manifest:
                raise self._refuse(Reason.DUPLICATE, "a different manifest was already accepted for this cache id")
            return
        e = self.expect
        if m.is_expired():
            err = self._refuse(Reason.EXPIRED, f"manifest expired at {m.expires_at:.3f} (unix)")
        elif e.fingerprint is not None and m.fingerprint != e.fingerprint:
            err = self._refuse(Reason.FINGERPRINT_MISMATCH,
                               f"KV from model {m.fingerprint[:16]}, decode runs {e.fingerprint[:16]}")
        elif e.token_digest is not None and m.token_digest != e.token_digest:
            err = self._refuse(Reason.TOKEN_DIGEST_MISMATCH, "KV was computed for a different prompt")
        elif e.tenant is not None and m.tenant != e.tenant:
            err = self._refuse(Reason.TENANT_MISMATCH, f"KV belongs to tenant {m.tenant!r}, expected {e.tenant!r}")
        elif e.manifest is not None and m != e.manifest:
            err = self._refuse(Reason.MANIFEST_MISMATCH, "manifest differs from the one the decode side registered")
        else:
            self.manifest = m
            return
        # A manifest for the right cache id but the wrong content is final: retrying cannot fix it.
        self.fail(err.reason, err.message)
        raise err

    # -- frames ---------------------------------------------------------------------------
    async def accept_frame(self, frame: Frame) -> None:
        """Verify, decode and deliver one frame; duplicates are acknowledged without a second write."""
        self._guard()
        m = self.manifest
        if m is None:
            raise self._refuse(Reason.MALFORMED, "frame before the manifest")
        try:
            entry = check_frame(m, frame)
        except WireError as exc:
            self.counters.refuse(exc.reason)
            if 0 <= frame.seq < m.frame_count and frame.seq not in self.checksums:
                self.refused_seqs.add(frame.seq)
            raise
        self.touch()
        seq = frame.seq
        if seq in self.checksums:
            self.counters.add("frames_duplicate")
            return
        pending = self.inflight.get(seq)
        if pending is not None:
            self.counters.add("frames_duplicate")
            await asyncio.shield(pending)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.inflight[seq] = fut
        try:
            args = (m.codec, frame.payload, frame.end - frame.start, entry.num_kv_heads, entry.head_dim,
                    entry.torch_dtype)
            try:
                if m.codec != "none" and frame.raw_len >= _THREAD_DECODE_BYTES:
                    k, v = await asyncio.to_thread(decode_kv, *args)
                else:
                    k, v = decode_kv(*args)
            except CodecError as exc:
                # The checksum matched, so the sender encoded garbage: retrying will not help.
                self.fail(Reason.CODEC, f"frame {seq}: {exc}")
                raise self._refuse(Reason.CODEC, f"frame {seq}: {exc}") from exc
            self._guard()  # a deadline may have passed while decoding: never write after it
            try:
                out = self.expect.sink(LayerKVChunk(layer=frame.layer, start=frame.start, k=k, v=v))
                if inspect.isawaitable(out):
                    await out
            except Exception as exc:
                self.fail(Reason.SINK_ERROR, f"frame {seq}: the sink raised {type(exc).__name__}: {exc}")
                raise self._refuse(Reason.SINK_ERROR, f"decode side could not import frame {seq}: {exc}") from exc
            self.checksums[seq] = frame.checksum
            self.refused_seqs.discard(seq)
            self.raw_bytes += frame.raw_len
            self.wire_bytes += frame.payload_len
            self.counters.add("frames_accepted")
            self.progress.set()
            fut.set_result(None)
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else TransferError(Reason.ABORTED, "cancelled"))
            fut.exception()
            raise
        finally:
            self.inflight.pop(seq, None)

    # -- commit ---------------------------------------------------------------------------
    def missing(self) -> list[int]:
        m = self.manifest
        assert m is not None
        return [s for s in range(m.frame_count) if s not in self.checksums]

    async def accept_commit(self, frame_count: int, digest: bytes, grace_s: float = 1.0) -> list[int]:
        """Return the frames still missing (empty: the transfer is now complete) or raise WireError.

        The sender commits as soon as its last frame is written, one round trip earlier than
        waiting for every acknowledgement; frames still travelling on other streams are waited
        for as long as some frame keeps arriving within `grace_s`.
        """
        if self.finished and self.done.exception() is None:
            return []  # a resent commit after a lost acknowledgement
        self._guard()
        m = self.manifest
        if m is None:
            raise self._refuse(Reason.MALFORMED, "commit before the manifest")
        self.touch()
        if frame_count != m.frame_count:
            raise self._refuse(Reason.COMMIT_DIGEST, f"commit counts {frame_count} frames, manifest {m.frame_count}")
        while (missing := self.missing()) and not self.done.done():
            if self.refused_seqs.issuperset(missing):
                # Every missing frame was refused here: its resend follows the sender reading that
                # answer, possibly behind this commit on the same stream, so waiting cannot help.
                break
            self.progress.clear()
            try:
                await asyncio.wait_for(self.progress.wait(), grace_s)
            except TimeoutError:
                break
        self._guard()
        if self.finished and self.done.exception() is None:
            return []  # another stream's commit completed it meanwhile
        if missing:
            self.counters.add("commits_incomplete")
            return missing
        if commit_digest([self.checksums[s] for s in range(m.frame_count)]) != digest:
            self.fail(Reason.COMMIT_DIGEST, "commit digest does not match the accepted frames")
            raise self._refuse(Reason.COMMIT_DIGEST, "commit digest does not match the accepted frames")
        self.counters.add("transfers_completed")
        self.done.set_result(m)
        return []


class TransferTable:
    """A receiver's expected transfers, and its finished ones for a while (every receiver keeps one).

    Finished transfers stay answerable (`lookup`, `transfer_bytes`) after `wait()` returned, so
    decode can still read what a transfer cost, and a sender whose commit answer was lost can
    reconnect and get it again instead of failing a transfer that succeeded.
    """

    def __init__(self, timeout_s: float, keep_finished: int = 1024) -> None:
        self.timeout_s = timeout_s  # silence bound of an Expectation that does not set one
        self.keep_finished = keep_finished
        self.counters = Counters()
        self.active: dict[str, Assembly] = {}
        self.finished: collections.OrderedDict[str, Assembly] = collections.OrderedDict()

    def expect(self, exp: Expectation) -> Assembly:
        """Register `exp` (call from the event loop); a cache id already expected is a ValueError."""
        if not isinstance(exp, Expectation):
            raise TypeError(f"expect() takes an Expectation, got {type(exp).__name__}")
        if exp.cache_id in self.active:
            raise ValueError(f"cache id {exp.cache_id!r} is already expected; cache ids must be unique per transfer")
        if exp.timeout_s is None:
            exp = dataclasses.replace(exp, timeout_s=self.timeout_s)
        self.finished.pop(exp.cache_id, None)
        a = self.active[exp.cache_id] = Assembly(exp, self.counters)
        self.counters.add("transfers_expected")
        return a

    def keep_alive(self, cache_id: str) -> bool:
        """The sender says, out of band, that it is still computing `cache_id` (queued, or
        prefilling with its next layers' KV not ready yet): restart the silence timer. The caller
        stops once the sender has computed everything (prefill's first token): from then on only
        frames count, so a stalled link is still noticed while its sender is well."""
        a = self.active.get(cache_id)
        if a is None or a.finished:
            return False
        a.touch()
        return True

    def lookup(self, cache_id: str) -> Assembly | None:
        """The transfer, whether still expected or recently finished."""
        return self.active.get(cache_id) or self.finished.get(cache_id)

    def retire(self, cache_id: str) -> Assembly | None:
        """Move a transfer from the expected ones to the finished ones; returns it (None if unknown)."""
        a = self.active.pop(cache_id, None)
        if a is not None:
            self.finished[cache_id] = a
            while len(self.finished) > self.keep_finished:
                self.finished.popitem(last=False)
        return a

    def transfer_bytes(self, cache_id: str) -> tuple[int, int]:
        a = self.lookup(cache_id)
        return (a.raw_bytes, a.wire_bytes) if a else (0, 0)
