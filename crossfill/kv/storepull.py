"""Store-and-pull transfer (M5.4): prefill lands encoded KV in a KV store, decode pulls and verifies it.

On a poor or intermittent link, or when decode is not ready yet, prefill need not hold a
connection: it writes the manifest, every frame and finally the commit as separate objects of a
`KVStore` (embedded memory+disk, or Mooncake Store), under the tenant of the manifest and with a
TTL that ends at the manifest's expiry.  The commit object is written last, so its presence means
"complete".  The puller on the decode side fetches frames as they appear (overlapping the upload)
and verifies them with the same `Assembly` as the TCP receiver: same reasons, same counters, the
sink sees only verified chunks, and `wait()` returns only after the commit digest matched.

Objects (tenant = manifest tenant):  kv/<cache_id>/manifest,  kv/<cache_id>/f/<seq>,  kv/<cache_id>/commit

Discovery: the puller learns of new objects from the store's change notifications when it has
them (`WatchableKVStore`, e.g. the embedded store), so it reads a key only once it was put; on a
store without them (Mooncake Store) it polls with a backoff that is short right after progress
and grows while idle. `StorePullReceiver.notify(cache_id)` is a wake-up hint for a control channel
that knows prefill committed. Every wait ends by the transfer's deadline.

At rest (`AtRest`, crossfill.security.kv_crypto): with a cipher every object is sealed before it
is put (AES-GCM under the tenant's key, bound to the cache id and object key) and opened after it
is read, so the store (its memory, disk files, a Mooncake segment) only ever holds ciphertext. An
object that does not open is quarantined: removed from the store at once, counted and audited,
and the transfer fails with `checksum` (decode falls back as for any bad frame); the rest of the
cache is removed with it. Objects that open but fail the transfer's checks are quarantined the
same way, as a cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, Self

from crossfill.kv.assembler import Assembly, Expectation, TransferTable
from crossfill.kv.backend import ReceiveBackend
from crossfill.kv.errors import Reason, TransferError, WireError
from crossfill.kv.sender import FrameSender, SenderBackend
from crossfill.kv.store.base import DEFAULT_TENANT, KVStore, StoreError, Watch, WatchableKVStore
from crossfill.kv.wire import (
    Frame,
    Manifest,
    manifest_body,
    parse_commit_body,
    parse_frame,
    parse_manifest_body,
)
from crossfill.security.kv_crypto import AtRest, SealError

log = logging.getLogger("crossfill.kv.storepull")

_MIN_TTL_S = 1.0
# With change notifications a missing key is read again only on a reported put, a hint, or this
# often: a guard against a notification a store failed to deliver, not a polling loop.
_WATCH_RECHECK_S = 1.0
# Failures that mean the stored bytes are wrong (not late, not refused by decode's own state):
# the cache is quarantined, not just dropped.
_BAD_BYTES = frozenset({
    Reason.MALFORMED, Reason.UNKNOWN_VERSION, Reason.FINGERPRINT_MISMATCH, Reason.TOKEN_DIGEST_MISMATCH,
    Reason.MANIFEST_MISMATCH, Reason.UNKNOWN_LAYER, Reason.TOKEN_RANGE, Reason.OVERSIZED, Reason.CHECKSUM,
    Reason.CODEC, Reason.COMMIT_DIGEST, Reason.TENANT_MISMATCH,
})
# Sleeps bounded by a deadline last this much longer, so the reader wakes after the deadline
# (and check_time() fails the transfer) rather than a hair before it and spinning.
_DEADLINE_SLACK_S = 0.001


def object_prefix(cache_id: str) -> str:
    """The prefix every object key of a transfer starts with (what the puller watches)."""
    return f"kv/{cache_id}/"


def object_keys(cache_id: str) -> tuple[str, str, str]:
    """(manifest key, frame key prefix, commit key) of a transfer."""
    base = object_prefix(cache_id)
    return f"{base}manifest", f"{base}f/", f"{base}commit"


def store_tenant(tenant: str) -> str:
    return tenant or DEFAULT_TENANT


def describe_store(store: KVStore) -> str:
    """How a receiver that pulls from `store` is reached: the store's address, or its kind."""
    return str(getattr(store, "address", None) or f"{type(store).__name__} (in process)")


class StoreService(Protocol):
    """A server that makes a store reachable (`crossfill.kv.store.remote.StoreServer`)."""

    @property
    def address(self) -> str: ...

    async def start(self) -> object: ...

    async def close(self) -> None: ...


class StorePushSender(SenderBackend):
    """Sending half: writes a transfer's objects into `store` (embedded, remote or Mooncake)."""

    name = "store"

    def __init__(self, store: KVStore, *, timeout_ms: int = 8000, max_retry: int = 2, parallel_puts: int = 4,
                 owns_store: bool = False, at_rest: AtRest | None = None) -> None:
        super().__init__(timeout_ms, max_retry)
        self.store = store
        self.at_rest = at_rest or AtRest()  # default: no cipher, objects stored as they are
        self.owns_store = owns_store  # close() closes the store (e.g. a RemoteStore made for this sender)
        self.parallel_puts = max(1, parallel_puts)

    def _transfer(self, manifest: Manifest) -> FrameSender:
        return _StoreTransfer(self, manifest)

    async def close(self) -> None:
        if self.owns_store:
            await asyncio.to_thread(self.store.close)


class _StoreTransfer(FrameSender):
    pin_frames = False  # a frame is in the store once its put returned: nothing to resend from memory

    def __init__(self, backend: StorePushSender, manifest: Manifest) -> None:
        super().__init__(manifest)
        self.b = backend
        self.tenant = store_tenant(manifest.tenant)
        self.pending: set[asyncio.Task[None]] = set()
        self.slots = asyncio.Semaphore(backend.parallel_puts)
        self.manifest_put = False

    def _ttl(self) -> float:
        return max(_MIN_TTL_S, self.m.expires_at - time.time())

    async def start(self) -> None:
        await self.put(object_keys(self.m.cache_id)[0], manifest_body(self.m))
        self.manifest_put = True

    async def put(self, key: str, data: bytes) -> None:
        """One object, retried up to max_retry times; each attempt bounded by timeout_ms."""
        for attempt in range(self.b.max_retry + 1):
            try:
                await asyncio.wait_for(asyncio.to_thread(self._seal_and_put, key, data), self.b.timeout_s)
                return
            except (StoreError, OSError, TimeoutError) as exc:
                if attempt == self.b.max_retry:
                    raise self._fail(Reason.CONNECTION,
                                     f"store put of {key} failed {attempt + 1} times: {exc}") from exc
                self.retransmits += 1
                await asyncio.sleep(0.05 * 2 ** attempt)

    def _seal_and_put(self, key: str, data: bytes) -> None:
        """In a worker thread: sealing a frame costs about as much as copying it a few times."""
        sealed = self.b.at_rest.seal(data, tenant=self.tenant, cache_id=self.m.cache_id, key=key)
        self.b.store.put(key, sealed, self._ttl(), self.tenant)

    async def _put_frame(self, key: str, data: bytes) -> None:
        try:
            await self.put(key, data)
        finally:
            self.slots.release()

    async def _ship(self, frame: Frame) -> None:
        await self.slots.acquire()  # bounded puts in flight: backpressure on a slow store
        task = asyncio.create_task(self._put_frame(f"{object_keys(self.m.cache_id)[1]}{frame.seq}", frame.body()))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _deliver_commit(self, body: bytes) -> None:
        results = await asyncio.gather(*self.pending, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise self.error or self._fail(Reason.CONNECTION, str(r))
        await self.put(object_keys(self.m.cache_id)[2], body)

    async def _tell_abort(self, reason: str) -> None:
        """Remove what was written: the puller then times out or finds no commit, never partial KV."""
        for t in list(self.pending):
            t.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
        if not self.manifest_put:
            return  # nothing was written (the store refused the manifest)
        manifest_key, prefix, commit_key = object_keys(self.m.cache_id)
        keys = [commit_key, manifest_key] + [f"{prefix}{s}" for s in self.checksums]
        removed = 0
        for key in keys:
            with contextlib.suppress(StoreError, OSError):
                removed += await asyncio.to_thread(self.b.store.delete, key, self.tenant)
        self.b.at_rest.deleted("aborted", tenant=self.tenant, cache_id=self.m.cache_id, objects=removed)

    async def _close(self) -> None:
        pass


class _Backoff:
    """Polling interval of one transfer: short right after progress, growing while idle, capped.

    The interval follows the idle *time* (a quarter of it), not the count of misses, so the
    several pollers of a prefetch window do not back off faster than one would, and the latency
    polling adds to a wait is at most a quarter of that wait (and at most `max_s`).
    """

    IDLE_FRACTION = 0.25

    def __init__(self, min_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_s = min_s
        self.max_s = max(min_s, max_s)
        self._clock = clock
        self._since = clock()

    def progress(self) -> None:
        """Something appeared (or a hint said it will): poll fast again."""
        self._since = self._clock()

    def delay(self) -> float:
        idle = self._clock() - self._since
        return min(self.max_s, max(self.min_s, idle * self.IDLE_FRACTION))


class _Wakeup:
    """Per-key wake-ups of one transfer's readers. Event-loop thread only.

    A reader arms its key *before* reading the store, so a put that lands after the read still
    sets the event it then sleeps on (register-then-check: no lost wake-up). `fire(None)` wakes
    every reader of the transfer (a control-channel hint, or the transfer finished).
    """

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def arm(self, key: str) -> asyncio.Event:
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = asyncio.Event()
        return event

    def disarm(self, key: str) -> None:
        self._events.pop(key, None)

    def fire(self, key: str | None = None) -> None:
        if key is None:
            events = list(self._events.values())
            self._events.clear()
        else:
            event = self._events.pop(key, None)
            events = [] if event is None else [event]
        for event in events:
            event.set()


@dataclass
class _Pull:
    """One expected transfer: its verifier, its pulling task and how that task learns of new objects."""

    assembly: Assembly
    tenant: str
    loop: asyncio.AbstractEventLoop
    backoff: _Backoff
    wake: _Wakeup = field(default_factory=_Wakeup)
    task: asyncio.Task[None] | None = None
    watch: Watch | None = None  # set while the store notifies us of puts
    quarantined: bool = False  # an object of the transfer did not open and was removed

    def on_put(self, key: str) -> None:
        """Store callback, on the putting thread: hand the key to the event loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self.wake.fire, key)

    def hint(self) -> None:
        """Objects may have landed (control channel): read at once and poll fast for a while."""
        self.backoff.progress()
        self.wake.fire(None)

    def stop_watching(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None


class StorePullReceiver(ReceiveBackend):
    """Receiving half: pulls and verifies transfers from `store` for the decode side.

    `expect()` registers a transfer and starts pulling at once: frames are fetched as they
    appear, so the download overlaps prefill's upload.  Consumed objects are deleted after a
    successful commit (and after a verification failure: a bad cache is not left for reuse).

    How the puller learns that an object appeared:
    - when the store is a `WatchableKVStore` (the embedded store), it watches the transfer's key
      prefix for its lifetime and reads a key again only when a put of that key is reported (or,
      as a guard, every `_WATCH_RECHECK_S`); the watch ends when the transfer completes, fails or
      is cancelled;
    - otherwise (Mooncake Store) it polls, every `poll_ms` right after progress and up to
      `max_poll_ms` while idle (see `_Backoff`);
    - either way `notify(cache_id)` (e.g. from a control channel that saw prefill commit) wakes
      the readers at once.
    Every sleep ends by the transfer's deadline (timeout_ms of silence, `deadline`, manifest expiry).
    """

    name = "store"

    def __init__(self, store: KVStore, *, timeout_ms: int = 8000, poll_ms: float = 2.0, max_poll_ms: float = 50.0,
                 prefetch: int = 4, delete_after_pull: bool = True, server: StoreService | None = None,
                 keep_finished: int = 1024, at_rest: AtRest | None = None) -> None:
        self.store = store
        self.at_rest = at_rest or AtRest()  # must match the senders' (same cipher on or off)
        self.server = server  # serves `store` to remote senders while this receiver runs (decode's KV port)
        self.timeout_s = timeout_ms / 1000
        self.poll_s = poll_ms / 1000
        self.max_poll_s = max_poll_ms / 1000
        self.prefetch = max(1, prefetch)
        self.delete_after_pull = delete_after_pull
        # Decided once: a wrapper that hides `watch` (as the benchmark's polling baseline does) polls.
        self._watch_store: WatchableKVStore | None = store if isinstance(store, WatchableKVStore) else None
        self.transfers = TransferTable(self.timeout_s, keep_finished)
        self._counters = self.transfers.counters
        self._pulls: dict[str, _Pull] = {}

    async def start(self) -> Self:
        if self.server is not None:
            await self.server.start()
        return self

    @property
    def address(self) -> str:
        if self.server is not None:
            return self.server.address
        return describe_store(self.store)

    def transfer_bytes(self, cache_id: str) -> tuple[int, int]:
        return self.transfers.transfer_bytes(cache_id)

    def expect(self, expectation: Expectation) -> None:
        a = self.transfers.expect(expectation)
        p = _Pull(a, store_tenant(a.expect.tenant or ""), asyncio.get_running_loop(),
                  _Backoff(self.poll_s, self.max_poll_s))
        a.done.add_done_callback(lambda _: p.wake.fire(None))  # finished or failed: no reader sleeps on
        p.task = asyncio.create_task(self._pull(p))
        p.task.add_done_callback(_retrieve)  # wait() reports it
        self._pulls[a.cache_id] = p

    async def wait(self, cache_id: str) -> Manifest:
        p = self._pulls.get(cache_id)
        if p is None:
            raise TransferError(Reason.UNKNOWN_CACHE_ID, "wait() for a cache id nobody expects", cache_id)
        assert p.task is not None
        try:
            await asyncio.shield(p.task)
            return p.assembly.done.result()
        finally:
            self._pulls.pop(cache_id, None)
            self.transfers.retire(cache_id)

    def keep_alive(self, cache_id: str) -> bool:
        return self.transfers.keep_alive(cache_id)

    def notify(self, cache_id: str) -> bool:
        """Wake-up hint: objects of `cache_id` have (probably) landed, e.g. prefill's commit.

        For a control channel that learns of the commit before polling would: the readers of the
        transfer read the store at once instead of at their next poll. Safe to call from any
        thread. Returns False (and does nothing) when the cache id is not being pulled; a hint that
        arrives before `expect()` is not needed, since `expect()` starts with a read.
        """
        p = self._pulls.get(cache_id)
        if p is None or p.assembly.finished:
            return False
        self._counters.add("notify_hints")
        if _running_loop() is p.loop:
            p.hint()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to wake
                p.loop.call_soon_threadsafe(p.hint)
        return True

    def cancel(self, cache_id: str, reason: str = "cancelled by decode") -> None:
        p = self._pulls.pop(cache_id, None)
        self.transfers.retire(cache_id)
        if p is not None:
            p.stop_watching()  # now, not when the task next runs: no listener outlives cancel()
            p.assembly.fail(Reason.ABORTED, reason)
            if p.task is not None:
                p.task.cancel()

    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    async def close(self) -> None:
        for cache_id in list(self._pulls):
            self.cancel(cache_id, "receiver closed")
        if self.server is not None:
            await self.server.close()

    # -- learning of new objects ------------------------------------------------------------
    def _subscribe(self, p: _Pull) -> None:
        """Watch the transfer's keys when the store can report puts; otherwise the readers poll."""
        if self._watch_store is None:
            return
        try:
            p.watch = self._watch_store.watch(object_prefix(p.assembly.cache_id), p.on_put, p.tenant)
        except (StoreError, OSError):
            self._counters.add("store_errors")  # fall back to polling; reads will report a dead store

    def _pause(self, p: _Pull, read_failed: bool) -> float:
        """How long a reader sleeps after a miss unless woken: the deadline bounds it in `_get`."""
        if p.watch is not None and not read_failed:
            return _WATCH_RECHECK_S
        return p.backoff.delay()

    async def _read(self, p: _Pull, key: str) -> tuple[bytes | None, bool]:
        """One get, bounded by the transfer's deadline: (data or None, whether the store failed)."""
        a = p.assembly
        self._counters.add("store_gets")
        try:
            async with asyncio.timeout(_time_left(a)):
                return await asyncio.to_thread(self._get_and_open, p, key), False
        except TimeoutError:
            return None, True  # the caller's check_time() fails the transfer on its deadline
        except (StoreError, OSError) as exc:
            self._counters.add("store_errors")
            if time.monotonic() - a.last_activity > a.expect.timeout_s / 2:
                a.fail(Reason.CONNECTION, f"store get of {key} keeps failing: {exc}")
            return None, True

    def _get_and_open(self, p: _Pull, key: str) -> bytes | None:
        """In a worker thread: the object's plaintext, None when absent, SealError when it does not open."""
        blob = self.store.get(key, p.tenant)
        if blob is None:
            return None
        return self.at_rest.open(blob, tenant=p.tenant, cache_id=p.assembly.cache_id, key=key)

    async def _quarantine(self, p: _Pull, key: str, exc: SealError) -> WireError:
        """An object that does not open: out of the store now, counted, audited; the transfer fails."""
        p.quarantined = True
        self._counters.add("quarantined")
        try:
            await asyncio.to_thread(self.store.delete, key, p.tenant)
        except (StoreError, OSError) as err:  # the cache cleanup after the failure tries again
            self._counters.add("store_errors")
            log.warning("store pull %s: cannot remove the quarantined object %s: %s", p.assembly.cache_id, key, err)
        self.at_rest.quarantined(exc.reason, tenant=p.tenant, cache_id=p.assembly.cache_id, key=key)
        return WireError(Reason.CHECKSUM, f"stored object {key} does not open ({exc}); quarantined")

    async def _get(self, p: _Pull, key: str) -> bytes:
        """Read `key` until it exists, sleeping between reads until woken; deadlines bound every sleep."""
        a = p.assembly
        try:
            while True:
                a.check_time()
                if a.done.done():
                    a.done.result()  # raises the failure
                woken = p.wake.arm(key)  # before the read: a put that lands after it still wakes us
                try:
                    data, failed = await self._read(p, key)
                except SealError as exc:
                    raise await self._quarantine(p, key, exc) from None
                if data is not None:
                    p.backoff.progress()
                    if self.at_rest.cipher is not None:
                        self._counters.add("sealed_opened")  # what shows that encryption was on
                    return data
                self._counters.add("store_misses")
                await _wait_event(woken, min(self._pause(p, failed), _time_left(a)))
        finally:
            p.wake.disarm(key)

    # -- pulling --------------------------------------------------------------------------
    async def _pull(self, p: _Pull) -> None:
        a = p.assembly
        self._subscribe(p)
        try:
            await self._fetch(p)
        except (WireError, TransferError):
            pass  # recorded in the Assembly; wait() raises it
        except Exception as exc:  # a store or sink failure nobody anticipated: still fail cleanly
            a.fail(Reason.ABORTED, f"{type(exc).__name__}: {exc}")
        finally:
            p.stop_watching()
            ok = a.done.done() and a.done.exception() is None
            if not a.done.done():
                a.fail(Reason.ABORTED, "pull stopped")
            failure = a.done.exception()
            if isinstance(failure, TransferError) and failure.reason in _BAD_BYTES and not p.quarantined:
                # Bytes that opened (or were never sealed) but fail the checks: the cache is bad.
                self._counters.add("quarantined")
                self.at_rest.quarantined(failure.reason.label, tenant=p.tenant, cache_id=a.cache_id,
                                         key=object_prefix(a.cache_id))
            if self.delete_after_pull or not ok:
                await self._delete(a, p.tenant, "consumed" if ok else "failed")
        if a.done.exception() is not None:
            raise a.done.exception()  # type: ignore[misc]

    async def _fetch(self, p: _Pull) -> None:
        m = await self._fetch_manifest(p)
        await self._fetch_frames(p, m)
        await self._fetch_commit(p)

    async def _fetch_manifest(self, p: _Pull) -> Manifest:
        a, cid = p.assembly, p.assembly.cache_id
        try:
            m = parse_manifest_body(await self._get(p, object_keys(cid)[0]))
            if m.cache_id != cid:
                raise WireError(Reason.MANIFEST_MISMATCH, f"object for {cid} holds cache id {m.cache_id}")
            a.accept_manifest(m)
        except WireError as exc:
            self._counters.refuse(exc.reason)
            a.fail(exc.reason, exc.message)
            raise
        return m

    async def _fetch_frames(self, p: _Pull, m: Manifest) -> None:
        """Frames in order, with up to `prefetch` reads ahead so the download overlaps the upload."""
        a, prefix = p.assembly, object_keys(p.assembly.cache_id)[1]
        window: dict[int, asyncio.Task[bytes]] = {}
        try:
            for next_seq in range(m.frame_count):
                for seq in range(next_seq, min(m.frame_count, next_seq + self.prefetch)):
                    if seq not in window:
                        window[seq] = asyncio.create_task(self._get(p, f"{prefix}{seq}"))
                        window[seq].add_done_callback(_retrieve)
                try:
                    frame = parse_frame(await window.pop(next_seq))
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
            for t in window.values():  # reads ahead of a failure (or of a cancel) are not needed
                t.cancel()

    async def _fetch_commit(self, p: _Pull) -> None:
        a = p.assembly
        try:
            count, digest = parse_commit_body(await self._get(p, object_keys(a.cache_id)[2]))
            missing = await a.accept_commit(count, digest, grace_s=0.0)
            if missing:
                raise WireError(Reason.INCOMPLETE, f"{len(missing)} frames missing at commit")
        except WireError as exc:
            a.fail(exc.reason, exc.message)
            raise

    async def _delete(self, a: Assembly, tenant: str, why: str) -> None:
        """Remove the transfer's objects in one thread hop (wait() returns after it), bounded by timeout_ms."""
        manifest_key, prefix, commit_key = object_keys(a.cache_id)
        keys = [commit_key, manifest_key]
        if a.manifest is not None:
            keys += [f"{prefix}{s}" for s in range(a.manifest.frame_count)]
        removed = 0
        with contextlib.suppress(TimeoutError):
            removed = await asyncio.wait_for(asyncio.to_thread(self._delete_keys, keys, tenant), self.timeout_s)
        self.at_rest.deleted(why, tenant=tenant, cache_id=a.cache_id, objects=removed)

    def _delete_keys(self, keys: list[str], tenant: str) -> int:
        removed = 0
        for key in keys:
            with contextlib.suppress(StoreError, OSError):
                removed += self.store.delete(key, tenant)
        return removed


def _time_left(a: Assembly) -> float:
    """Seconds until the earliest of the transfer's deadlines, plus a little so that a sleep of this
    length ends after the deadline (check_time() then fails it) rather than a hair before."""
    now = time.monotonic()
    left = a.last_activity + a.expect.timeout_s - now
    if a.expect.deadline is not None:
        left = min(left, a.expect.deadline - now)
    if a.manifest is not None:
        left = min(left, a.manifest.expires_at - time.time())
    return max(0.0, left) + _DEADLINE_SLACK_S


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Return when `event` is set or after `timeout_s`, whichever comes first."""
    if event.is_set():
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _retrieve(task: asyncio.Task) -> None:
    """Mark a task's exception as seen: its owner reports the failure through the Assembly."""
    if not task.cancelled():
        task.exception()
