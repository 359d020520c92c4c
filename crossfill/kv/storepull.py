"""Store-and-pull transfer (M5.4): prefill lands encoded KV in a KV store, decode pulls and verifies it.

On a poor or intermittent link, or when decode is not ready yet, prefill need not hold a
connection: it writes the manifest, every frame and finally the commit as separate objects of a
`KVStore` (embedded memory+disk, or Mooncake Store), under the tenant of the manifest and with a
TTL that ends at the manifest's expiry.  The commit object is written last, so its presence means
"complete".  The puller on the decode side fetches frames as they appear (overlapping the upload)
and verifies them with the same `Assembly` as the TCP receiver: same reasons, same counters, the
sink sees only verified chunks, and `wait()` returns only after the commit digest matched.

Objects (tenant = manifest tenant):  kv/<cache_id>/manifest,  kv/<cache_id>/f/<seq>,  kv/<cache_id>/commit
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Assembly, Counters, Expectation, Sink
from crossfill.kv.backend import OutgoingTransfer, ReceiveBackend, TransferBackend, TransferStats
from crossfill.kv.chunker import ChunkError, FrameCutter, encode_piece
from crossfill.kv.errors import Reason, TransferError, WireError
from crossfill.kv.store.base import DEFAULT_TENANT, KVStore, StoreError
from crossfill.kv.wire import (
    Manifest,
    commit_body,
    commit_digest,
    manifest_body,
    parse_commit_body,
    parse_frame,
    parse_manifest_body,
)

_MIN_TTL_S = 1.0


def object_keys(cache_id: str) -> tuple[str, str, str]:
    """(manifest key, frame key prefix, commit key) of a transfer."""
    base = f"kv/{cache_id}"
    return f"{base}/manifest", f"{base}/f/", f"{base}/commit"


def store_tenant(tenant: str) -> str:
    return tenant or DEFAULT_TENANT


class StorePushSender(TransferBackend):
    """Sending half: writes a transfer's objects into `store`."""

    name = "store"

    def __init__(self, store: KVStore, *, timeout_ms: int = 8000, max_retry: int = 2, parallel_puts: int = 4) -> None:
        self.store = store
        self.timeout_s = timeout_ms / 1000
        self.max_retry = max_retry
        self.parallel_puts = max(1, parallel_puts)

    @contextlib.asynccontextmanager
    async def open(self, manifest: Manifest) -> AsyncIterator[OutgoingTransfer]:
        tx = _StoreTransfer(self, manifest)
        await tx.put(object_keys(manifest.cache_id)[0], manifest_body(manifest))
        try:
            yield tx
        except BaseException as exc:
            await tx.abort(f"sender raised {type(exc).__name__}: {exc}")
            raise
        finally:
            if not tx.committed:
                await tx.abort("transfer left without commit()")


class _StoreTransfer(OutgoingTransfer):
    def __init__(self, backend: StorePushSender, manifest: Manifest) -> None:
        self.b = backend
        self.m = manifest
        self.tenant = store_tenant(manifest.tenant)
        self.cutter = FrameCutter(manifest)
        self.checksums: dict[int, int] = {}
        self.pending: set[asyncio.Task[None]] = set()
        self.slots = asyncio.Semaphore(backend.parallel_puts)
        self.error: TransferError | None = None
        self.committed = False
        self.raw_bytes = self.wire_bytes = self.retries = 0
        self.t_open = time.monotonic()
        self.t_last_send = self.t_open

    def _ttl(self) -> float:
        return max(_MIN_TTL_S, self.m.expires_at - time.time())

    async def put(self, key: str, data: bytes) -> None:
        """One object, retried up to max_retry times; each attempt bounded by timeout_ms."""
        for attempt in range(self.b.max_retry + 1):
            try:
                await asyncio.wait_for(asyncio.to_thread(self.b.store.put, key, data, self._ttl(), self.tenant),
                                       self.b.timeout_s)
                return
            except (StoreError, OSError, TimeoutError) as exc:
                if attempt == self.b.max_retry:
                    self.error = self.error or TransferError(
                        Reason.CONNECTION, f"store put of {key} failed {attempt + 1} times: {exc}", self.m.cache_id)
                    raise self.error from exc
                self.retries += 1
                await asyncio.sleep(0.05 * 2 ** attempt)

    async def _put_frame(self, key: str, data: bytes) -> None:
        try:
            await self.put(key, data)
        finally:
            self.slots.release()

    async def send(self, chunk: LayerKVChunk) -> None:
        if self.error is not None:
            raise self.error
        if self.committed:
            raise RuntimeError("send() after commit()")
        prefix = object_keys(self.m.cache_id)[1]
        for piece in self.cutter.cut(chunk):
            frame = await asyncio.to_thread(encode_piece, self.m, piece) if self.m.codec != "none" \
                else encode_piece(self.m, piece)
            self.checksums[frame.seq] = frame.checksum
            self.raw_bytes += frame.raw_len
            self.wire_bytes += frame.payload_len
            await self.slots.acquire()  # bounded puts in flight: backpressure on a slow store
            task = asyncio.create_task(self._put_frame(f"{prefix}{frame.seq}", frame.body()))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        self.t_last_send = time.monotonic()

    async def commit(self) -> TransferStats:
        missing = self.cutter.incomplete()
        if missing:
            raise ChunkError("commit() before all KV was sent: " + "; ".join(missing[:4]))
        results = await asyncio.gather(*self.pending, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise self.error or TransferError(Reason.CONNECTION, str(r), self.m.cache_id)
        digest = commit_digest([self.checksums[s] for s in range(self.m.frame_count)])
        await self.put(object_keys(self.m.cache_id)[2], commit_body(self.m.frame_count, digest))
        self.committed = True
        now = time.monotonic()
        return TransferStats(self.m.cache_id, self.m.frame_count, self.raw_bytes, self.wire_bytes, self.retries, 0,
                             now - self.t_open, now - self.t_last_send)

    async def abort(self, reason: str) -> None:
        """Remove what was written: the puller then times out or finds no commit, never partial KV."""
        for t in list(self.pending):
            t.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
        manifest_key, prefix, commit_key = object_keys(self.m.cache_id)
        keys = [commit_key, manifest_key] + [f"{prefix}{s}" for s in self.checksums]
        for key in keys:
            with contextlib.suppress(StoreError, OSError):
                await asyncio.to_thread(self.b.store.delete, key, self.tenant)
        self.committed = True  # nothing left to do on exit


class StorePullReceiver(ReceiveBackend):
    """Receiving half: pulls and verifies transfers from `store` for the decode side.

    `expect()` registers a transfer and starts pulling at once: frames are fetched as they
    appear, so the download overlaps prefill's upload.  Consumed objects are deleted after a
    successful commit (and after a verification failure: a bad cache is not left for reuse).
    """

    name = "store"

    def __init__(self, store: KVStore, *, timeout_ms: int = 8000, poll_ms: float = 5.0, prefetch: int = 4,
                 delete_after_pull: bool = True) -> None:
        self.store = store
        self.timeout_s = timeout_ms / 1000
        self.poll_s = poll_ms / 1000
        self.prefetch = max(1, prefetch)
        self.delete_after_pull = delete_after_pull
        self._counters = Counters()
        self._pulls: dict[str, tuple[Assembly, asyncio.Task[None]]] = {}

    def expect(self, target: Expectation | str, sink: Sink | None = None, *, fingerprint: str | None = None,
               token_digest: str | None = None, tenant: str | None = None, timeout_ms: int | None = None,
               deadline: float | None = None) -> None:
        if isinstance(target, Expectation):
            exp = target
        else:
            if sink is None:
                raise ValueError("expect() needs a sink callable that imports verified LayerKVChunks")
            exp = Expectation(cache_id=target, sink=sink, fingerprint=fingerprint, token_digest=token_digest,
                              tenant=tenant, timeout_s=(timeout_ms / 1000) if timeout_ms else self.timeout_s,
                              deadline=deadline)
        if exp.cache_id in self._pulls:
            raise ValueError(f"cache id {exp.cache_id!r} is already expected; cache ids must be unique per transfer")
        a = Assembly(exp, self._counters)
        self._counters.add("transfers_expected")
        task = asyncio.create_task(self._pull(a))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # wait() reports it
        self._pulls[exp.cache_id] = (a, task)

    async def wait(self, cache_id: str) -> Manifest:
        entry = self._pulls.get(cache_id)
        if entry is None:
            raise TransferError(Reason.UNKNOWN_CACHE_ID, "wait() for a cache id nobody expects", cache_id)
        a, task = entry
        try:
            await asyncio.shield(task)
            return a.done.result()
        finally:
            self._pulls.pop(cache_id, None)

    def cancel(self, cache_id: str, reason: str = "cancelled by decode") -> None:
        entry = self._pulls.pop(cache_id, None)
        if entry is not None:
            entry[0].fail(Reason.ABORTED, reason)
            entry[1].cancel()

    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    async def close(self) -> None:
        for cache_id in list(self._pulls):
            self.cancel(cache_id, "receiver closed")

    # -- pulling --------------------------------------------------------------------------
    async def _get(self, a: Assembly, key: str, tenant: str) -> bytes:
        """Poll for an object until it exists; the Assembly's deadlines bound the wait."""
        delay = self.poll_s
        while True:
            a.check_time()
            if a.done.done():
                a.done.result()  # raises the failure
            try:
                data = await asyncio.to_thread(self.store.get, key, tenant)
            except (StoreError, OSError) as exc:
                data = None
                self._counters.add("store_errors")
                if time.monotonic() - a.last_activity > a.expect.timeout_s / 2:
                    a.fail(Reason.CONNECTION, f"store get of {key} keeps failing: {exc}")
            if data is not None:
                return data
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _pull(self, a: Assembly) -> None:
        cid = a.cache_id
        manifest_key, prefix, commit_key = object_keys(cid)
        tenant = store_tenant(a.expect.tenant or "")
        try:
            try:
                m = parse_manifest_body(await self._get(a, manifest_key, tenant))
                if m.cache_id != cid:
                    raise WireError(Reason.MANIFEST_MISMATCH, f"object for {cid} holds cache id {m.cache_id}")
                a.accept_manifest(m)
            except WireError as exc:
                self._counters.refuse(exc.reason)
                a.fail(exc.reason, exc.message)
                raise
            next_seq = 0
            window: dict[int, asyncio.Task[bytes]] = {}
            while next_seq < m.frame_count:
                for seq in range(next_seq, min(m.frame_count, next_seq + self.prefetch)):
                    if seq not in window:
                        window[seq] = asyncio.create_task(self._get(a, f"{prefix}{seq}", tenant))
                try:
                    data = await window.pop(next_seq)
                    frame = parse_frame(data)
                    if frame.seq != next_seq:
                        raise WireError(Reason.TOKEN_RANGE, f"object {prefix}{next_seq} holds frame {frame.seq}")
                    await a.accept_frame(frame)
                except WireError as exc:
                    if exc.reason in (Reason.MALFORMED, Reason.TOKEN_RANGE):
                        self._counters.refuse(exc.reason)
                    # Stored bytes do not heal by reading them again: the cache is bad.
                    a.fail(exc.reason, exc.message)
                    raise
                finally:
                    if a.done.done() and a.done.exception() is not None:
                        for t in window.values():
                            t.cancel()
                next_seq += 1
            try:
                count, digest = parse_commit_body(await self._get(a, commit_key, tenant))
                missing = await a.accept_commit(count, digest, grace_s=0.0)
                if missing:
                    raise WireError(Reason.INCOMPLETE, f"{len(missing)} frames missing at commit")
            except WireError as exc:
                a.fail(exc.reason, exc.message)
                raise
        except (WireError, TransferError):
            pass  # recorded in the Assembly; wait() raises it
        except Exception as exc:  # a store or sink failure nobody anticipated: still fail cleanly
            a.fail(Reason.ABORTED, f"{type(exc).__name__}: {exc}")
        finally:
            ok = a.done.done() and a.done.exception() is None
            if not a.done.done():
                a.fail(Reason.ABORTED, "pull stopped")
            if self.delete_after_pull or not ok:
                await self._delete(a, tenant)
        if a.done.exception() is not None:
            raise a.done.exception()  # type: ignore[misc]

    async def _delete(self, a: Assembly, tenant: str) -> None:
        manifest_key, prefix, commit_key = object_keys(a.cache_id)
        keys = [commit_key, manifest_key]
        if a.manifest is not None:
            keys += [f"{prefix}{s}" for s in range(a.manifest.frame_count)]
        for key in keys:
            with contextlib.suppress(StoreError, OSError):
                await asyncio.to_thread(self.store.delete, key, tenant)
