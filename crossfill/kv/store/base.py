"""The byte-level KV store interface shared by the embedded store and Mooncake Store.

Store-and-pull transfer (M5.4) lands compressed KV in fast storage and lets decode pull it. The
backend on top only needs opaque bytes under a key, so this interface is deliberately small:
put / get / delete / exists / stats, each scoped by tenant (M5.9: tenant-isolated KV storage).

The interface is synchronous and every implementation is thread-safe. Both real stores block on
I/O (disk, or Mooncake's C++ client), so asyncio callers wrap calls with `asyncio.to_thread` (or use
`AsyncKVStore`, which does exactly that) instead of every store re-implementing an event loop.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

DEFAULT_TENANT = "default"

# Tenants become key prefixes (Mooncake) and file headers (embedded), so they are kept to a
# character set that can never contain the prefix separator or escape a path.
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_KEY_CHARS = 512


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
