"""The byte-level KV store interface shared by the embedded store and Mooncake Store.

Store-and-pull transfer (M5.4) lands compressed KV in fast storage and lets decode pull it. The
backend on top only needs opaque bytes under a key, so this interface is deliberately small:
put / get / delete / exists / stats, each scoped by tenant (M5.9: tenant-isolated KV storage).

Change notification is an optional capability on top (`WatchableKVStore.watch`): a store that can
tell a reader "a key under this prefix was just put" spares the decode-side puller its polling
(and the store its exists/get calls while the reader waits). Stores that cannot (Mooncake Store
has no watch API) simply lack the method; readers check with `isinstance(store,
WatchableKVStore)` and poll otherwise.

The interface is synchronous and every implementation is thread-safe. Both real stores block on
I/O (disk, or Mooncake's C++ client), so asyncio callers wrap calls with `asyncio.to_thread` (or use
`AsyncKVStore`, which does exactly that) instead of every store re-implementing an event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

DEFAULT_TENANT = "default"

# Tenants become key prefixes (Mooncake) and file headers (embedded), so they are kept to a
# character set that can never contain the prefix separator or escape a path.
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_KEY_CHARS = 512

# Called with the key that was put (the tenant is the one given to `watch`).
KeyCallback = Callable[[str], None]

_log = logging.getLogger(__name__)


class StoreError(Exception):
    """Base class of every error a KV store raises on purpose."""


class InvalidArgumentError(StoreError, ValueError):
    """An argument the store refuses; the message names it and says what is accepted."""


class InvalidKeyError(InvalidArgumentError):
    """A key or tenant that the store refuses (empty, too long, or bad characters)."""


class ObjectTooLargeError(StoreError):
    """A single object larger than the store can ever hold; evicting others would not help."""


class StoreUnavailableError(StoreError):
    """The store's backing service (e.g. the Mooncake master) cannot be reached or refused."""


@dataclass(frozen=True)
class StoreStats:
    """Counters and occupancy of a store, for metrics and `crossfill` diagnostics.

    Counters are cumulative since the store was opened; `objects` and the byte fields are current.
    """

    objects: int
    memory_bytes: int
    disk_bytes: int
    capacity_bytes: int
    puts: int
    hits: int
    misses: int
    deletes: int
    evictions: int
    expirations: int
    # Bytes of removed objects overwritten with zeros before release (memory buffers and disk
    # files), the observable of secure deletion (M5.9); 0 for stores that cannot (Mooncake).
    wiped_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


@runtime_checkable
class KVStore(Protocol):
    """Opaque bytes under (tenant, key), with a time to live.

    - `put` replaces any existing value of the same (tenant, key). `ttl_s=None` uses the store's
      default TTL; the value is unreachable once the TTL has passed.
    - `get` returns the bytes, or None when the key is absent, expired, evicted or belongs to
      another tenant: a tenant can never tell another tenant's keys from missing ones.
    - `delete` returns whether something was removed.
    """

    def put(
        self, key: str, data: bytes, ttl_s: float | None = None, tenant: str = DEFAULT_TENANT
    ) -> None: ...

    def get(self, key: str, tenant: str = DEFAULT_TENANT) -> bytes | None: ...

    def delete(self, key: str, tenant: str = DEFAULT_TENANT) -> bool: ...

    def exists(self, key: str, tenant: str = DEFAULT_TENANT) -> bool: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


class Watch:
    """Handle of one `watch()` registration; `close()` ends it.

    `close()` is idempotent, thread-safe and does no I/O, so an event loop may call it directly.
    No put that starts after `close()` returned calls the callback; a put already dispatching on
    another thread may still call it once, so a callback must tolerate a late call (the
    store-and-pull reader's callback only schedules a wake-up, which is a no-op by then).
    """

    def __init__(self, unregister: Callable[[], None]) -> None:
        self._unregister: Callable[[], None] | None = unregister
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            unregister, self._unregister = self._unregister, None
        if unregister is not None:
            unregister()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class WatchableKVStore(KVStore, Protocol):
    """A `KVStore` that reports puts as they happen (optional capability).

    `watch(prefix, callback, tenant)` calls `callback(key)` after every successful `put` of a key
    of `tenant` that starts with `prefix` (an empty prefix: every key of the tenant), until the
    returned `Watch` is closed. Contract, which readers rely on:

    - The callback runs after the put is visible: a `get` of `key` from the callback (or from
      anything it wakes) finds the new value, unless a later delete/expiry removed it again.
    - No put that starts after `watch()` returned is missed. Puts before that are not reported,
      so a reader registers first and then reads once (register-then-check; no lost wake-up).
    - It is a hint, not a delivery: only puts are reported (not deletes, expiry or eviction),
      the value is not passed, and the reader must read the store to act on it.
    - The callback runs on the putting thread, outside the store's locks; it must be quick and
      must not block (an asyncio reader hands it to its loop with `call_soon_threadsafe`).
      An exception from it is logged and never fails the put.
    - `watch()` and `Watch.close()` do no I/O, so an event loop may call them directly.
    """

    def watch(self, prefix: str, callback: KeyCallback, tenant: str = DEFAULT_TENANT) -> Watch: ...


class WatchRegistry:
    """The listener bookkeeping behind `WatchableKVStore.watch`, for stores to reuse.

    Listeners are indexed by (tenant, prefix); a put looks up each distinct prefix length the
    tenant's listeners use, so its cost does not grow with the number of concurrent transfers
    (their prefixes `kv/<cache_id>/` mostly share one length).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[tuple[str, str], dict[int, KeyCallback]] = {}
        self._lengths: dict[str, Counter[int]] = {}
        self._ids = itertools.count()

    def add(self, tenant: str, prefix: str, callback: KeyCallback) -> Watch:
        ident = next(self._ids)
        with self._lock:
            self._listeners.setdefault((tenant, prefix), {})[ident] = callback
            self._lengths.setdefault(tenant, Counter())[len(prefix)] += 1
        return Watch(lambda: self._remove(tenant, prefix, ident))

    def _remove(self, tenant: str, prefix: str, ident: int) -> None:
        with self._lock:
            listeners = self._listeners.get((tenant, prefix))
            if listeners is None or listeners.pop(ident, None) is None:
                return  # already gone (e.g. the store was closed and cleared)
            if not listeners:
                del self._listeners[(tenant, prefix)]
            lengths = self._lengths[tenant]
            lengths[len(prefix)] -= 1
            if lengths[len(prefix)] == 0:
                del lengths[len(prefix)]
            if not lengths:
                del self._lengths[tenant]

    def notify(self, tenant: str, key: str) -> None:
        """Call the listeners matching a put of (tenant, key); call it after the put is visible."""
        if not self._listeners:  # the common case: nobody waits; skip the lock
            return
        with self._lock:
            lengths = self._lengths.get(tenant, ())
            matched = [
                cb
                for n in lengths
                if n <= len(key)
                for cb in self._listeners.get((tenant, key[:n]), {}).values()
            ]
        for cb in matched:  # outside the lock: a callback may itself watch or close a Watch
            try:
                cb(key)
            except Exception:  # the put already happened; a listener's bug must not fail it
                _log.exception("a KV store watch callback for %r raised", key)

    def clear(self) -> None:
        with self._lock:
            self._listeners.clear()
            self._lengths.clear()

    def __len__(self) -> int:
        """How many watches are registered (tests use it to prove none leaks)."""
        with self._lock:
            return sum(len(v) for v in self._listeners.values())


def wipe(buf: Any) -> int:
    """Overwrite a mutable buffer with zeros in place (bytearray, writable memoryview, numpy array,
    torch tensor); returns the bytes wiped. Release it afterwards: its old contents are gone from
    this memory, not from copies made earlier (the caller's own, a page swapped out)."""
    if hasattr(buf, "zero_"):  # torch.Tensor
        buf.zero_()
        return int(buf.numel() * buf.element_size())
    view = memoryview(buf).cast("B")
    n = len(view)
    if n:
        ctypes.memset((ctypes.c_char * n).from_buffer(view), 0, n)
    view.release()
    return n


def check_tenant(tenant: str) -> str:
    """Validate a tenant id; return it unchanged."""
    if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
        raise InvalidKeyError(
            f"invalid tenant {tenant!r}: use 1-64 characters from letters, digits, '_', '.', '-'"
        )
    return tenant


def check_key(key: str) -> str:
    """Validate a key; return it unchanged. Any printable text up to MAX_KEY_CHARS is allowed."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid key {key!r}: a key must be a non-empty string")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidKeyError(f"key of {len(key)} characters is too long: at most {MAX_KEY_CHARS}")
    if not key.isprintable():
        raise InvalidKeyError(f"invalid key {key!r}: it contains non-printable characters")
    return key


def check_names(key: str, tenant: str) -> None:
    """Validate the (key, tenant) of a store call."""
    check_key(key)
    check_tenant(tenant)


@contextlib.contextmanager
def guarded(lock: threading.Lock | threading.RLock, check_open: Callable[[], None], key: str,
            tenant: str) -> Iterator[None]:
    """The opening of a store's per-key call: validate the names, take the lock, refuse if closed."""
    check_names(key, tenant)
    with lock:
        check_open()
        yield


def check_prefix(prefix: str) -> str:
    """Validate a watch prefix; return it unchanged. Like a key, but it may be empty (every key)."""
    if not isinstance(prefix, str) or len(prefix) > MAX_KEY_CHARS or not prefix.isprintable():
        raise InvalidKeyError(
            f"invalid watch prefix {prefix!r}: use printable text of at most {MAX_KEY_CHARS} characters"
        )
    return prefix


def check_ttl(ttl_s: float | None) -> float | None:
    """Validate a TTL in seconds (None means the store's default)."""
    if ttl_s is not None and not ttl_s > 0:
        raise InvalidArgumentError(f"invalid ttl_s {ttl_s!r}: a time to live must be > 0 seconds (or None)")
    return ttl_s


class ExpirySweeper:
    """Optional background thread that purges expired objects every `interval_s` seconds.

    Both stores expire lazily on access; the sweeper also frees the memory, disk or cluster space
    of objects nobody reads again.
    """

    def __init__(self, purge: Callable[[], int], interval_s: float | None, name: str) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s is None:
            return
        if not interval_s > 0:
            raise InvalidArgumentError(f"sweep_interval_s must be > 0 seconds, got {interval_s}")
        self._purge = purge
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name=name, daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self._purge()
            except StoreError:
                return  # the store was closed under us

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
