"""The embedded KV store: a memory tier over an optional disk tier, in this process.

Why two tiers: decode pulls KV soon after prefill lands it, so the hot path is memory; a disk tier
absorbs bursts and survives a restart of the process (M4.4 "persist") without a separate service.

Policy, in one place:
- A put goes to memory when the object fits the memory capacity, else straight to disk.
- When memory is full, the least recently used memory objects are demoted to disk (or evicted when
  there is no disk tier, or they do not fit it); when disk is full, its LRU objects are evicted.
- A get refreshes recency but does not promote a disk object back to memory: KV is usually read
  once by the decode that pulls it, so promotion would only churn the memory tier.
- Expired objects are unreachable at once (checked on every access) and removed by `purge_expired`,
  which every put runs and an optional background sweeper runs periodically, so an expired object's
  disk file does not outlive its TTL by more than `sweep_interval_s`.
- Secure deletion (M5.9 "secure deletion of expired caches"), unless `secure_delete=False`: the
  memory tier holds each object in a buffer of its own (a bytearray copied on put; `get` returns
  a copy), which is zeroed when the object is deleted, evicted, expired, demoted to disk or the
  store closes; disk files are overwritten with zeros, synced, then unlinked. `stats().wiped_bytes`
  counts both. What a store cannot wipe: copies callers made, and blocks an SSD or a copy-on-write
  file system remaps, which is why store-and-pull also seals KV at rest (crossfill.security.kv_crypto).
- Expiry times are wall-clock (`time.time`) so that they stay meaningful across a restart.
- Change notification (`watch`, see `WatchableKVStore` in base.py): every put calls the matching
  listeners after the store lock is released, so a reader woken by it finds the value and a slow
  listener never stalls other writers. Listeners live in memory only and end with `close()`.

Disk file layout (one file per object, named by a digest of tenant and key so no user text reaches
the file system): MAGIC, a 4-byte big-endian header length, a JSON header {tenant, key, size,
expires_at}, then the payload. Files are written to a temporary name and renamed, so a crash never
leaves a half-written object that a restart would serve.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crossfill.kv.store.base import (
    DEFAULT_TENANT,
    ExpirySweeper,
    InvalidArgumentError,
    KeyCallback,
    ObjectTooLargeError,
    StoreError,
    StoreStats,
    Watch,
    WatchRegistry,
    check_names,
    check_prefix,
    check_tenant,
    check_ttl,
    guarded,
    wipe,
)

MAGIC = b"CFKVSTORE1\n"
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_ZERO_CHUNK = bytes(1 << 20)


@dataclass
class _Entry:
    tenant: str
    key: str
    size: int
    expires_at: float
    seq: int  # identifies this version of the key in the expiry heap
    data: bytearray | None = None  # set when in memory; a buffer of the store's own, wiped on removal
    path: Path | None = None  # set when on disk


class EmbeddedStore:
    """A thread-safe, in-process `WatchableKVStore` with memory and disk tiers, TTL, LRU and byte limits.

    Args:
        memory_capacity_bytes: bytes of payload kept in memory.
        disk_dir: directory of the disk tier; None for memory only. Objects already there from an
            earlier run are loaded (expired ones are deleted).
        disk_capacity_bytes: bytes of payload kept on disk (ignored without `disk_dir`).
        default_ttl_s: TTL of a put that gives none.
        sweep_interval_s: run `purge_expired` in a background thread this often; None for no thread.
        secure_delete: zero memory buffers and overwrite disk files before releasing or removing them.
        clock: wall-clock source in seconds (tests pass a fake one to expire without sleeping).
    """

    def __init__(
        self,
        memory_capacity_bytes: int = 1 << 30,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_capacity_bytes: int = 0,
        default_ttl_s: float = 600.0,
        sweep_interval_s: float | None = None,
        secure_delete: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if memory_capacity_bytes < 0:
            raise InvalidArgumentError(f"memory_capacity_bytes must be >= 0, got {memory_capacity_bytes}")
        if disk_capacity_bytes < 0:
            raise InvalidArgumentError(f"disk_capacity_bytes must be >= 0, got {disk_capacity_bytes}")
        if disk_dir is not None and disk_capacity_bytes == 0:
            raise InvalidArgumentError(
                "disk_dir is set but disk_capacity_bytes is 0: give the disk tier a size"
            )
        check_ttl(default_ttl_s)
        self._mem_cap = memory_capacity_bytes
        self._disk_dir = Path(disk_dir) if disk_dir is not None else None
        self._disk_cap = disk_capacity_bytes if self._disk_dir is not None else 0
        self._default_ttl = default_ttl_s
        self._secure_delete = secure_delete
        self._clock = clock
        self._lock = threading.RLock()
        # LRU order over both tiers: first = least recently used.
        self._index: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._expiry: list[tuple[float, int, str, str]] = []
        self._seq = itertools.count()
        self._mem_used = 0
        self._disk_used = 0
        self._counts = dict.fromkeys(
            ("puts", "hits", "misses", "deletes", "evictions", "expirations", "wiped_bytes"), 0
        )
        self._closed = False
        self._watches = WatchRegistry()
        if self._disk_dir is not None:
            self._disk_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._load_disk()
        self._sweeper = ExpirySweeper(self.purge_expired, sweep_interval_s, "kvstore-sweeper")

    # ------------------------------------------------------------------ KVStore API

    def put(self, key: str, data: bytes, ttl_s: float | None = None, tenant: str = DEFAULT_TENANT) -> None:
        check_names(key, tenant)
        check_ttl(ttl_s)
        size = memoryview(data).nbytes
        largest = max(self._mem_cap, self._disk_cap)
        if size > largest:
            raise ObjectTooLargeError(
                f"object {key!r} is {size} bytes but the store holds at most {largest} bytes per object "
                f"(memory_capacity_bytes={self._mem_cap}, disk_capacity_bytes={self._disk_cap}); "
                "raise a capacity or split the object"
            )
        with self._lock:
            self._check_open()
            now = self._clock()
            self._purge_expired_locked(now)
            self._drop_locked((tenant, key))
            entry = _Entry(tenant, key, size, now + (ttl_s or self._default_ttl), next(self._seq))
            if size <= self._mem_cap:
                self._make_room_in_memory(size)
                entry.data = bytearray(data)  # our own copy: the caller's buffer is not ours to wipe
                self._mem_used += size
            else:
                self._make_room_on_disk(size)
                self._write_disk(entry, data)
            self._index[(tenant, key)] = entry
            heapq.heappush(self._expiry, (entry.expires_at, entry.seq, tenant, key))
            self._counts["puts"] += 1
        self._watches.notify(tenant, key)  # after the lock: the value is visible to whoever wakes

    def get(self, key: str, tenant: str = DEFAULT_TENANT) -> bytes | None:
        with guarded(self._lock, self._check_open, key, tenant):
            entry = self._live_entry(tenant, key)
            if entry is None:
                self._counts["misses"] += 1
                return None
            self._index.move_to_end((tenant, key))
            if entry.data is not None:
                data = bytes(entry.data)  # a copy: the stored buffer is wiped when the object goes
            else:
                data = self._read_disk(entry)
            self._counts["hits"] += 1
            return data

    def delete(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        with guarded(self._lock, self._check_open, key, tenant):
            if self._live_entry(tenant, key) is None:
                return False
            self._drop_locked((tenant, key))
            self._counts["deletes"] += 1
            return True

    def exists(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        with guarded(self._lock, self._check_open, key, tenant):
            return self._live_entry(tenant, key) is not None

    def watch(self, prefix: str, callback: KeyCallback, tenant: str = DEFAULT_TENANT) -> Watch:
        """Call `callback(key)` after each put of a `tenant` key starting with `prefix` (see base.py)."""
        check_prefix(prefix)
        check_tenant(tenant)
        with self._lock:  # so that close() cannot slip between the check and the registration
            self._check_open()
            return self._watches.add(tenant, prefix, callback)

    def watch_count(self) -> int:
        """Registered watches; a reader that ended every transfer leaves none behind."""
        return len(self._watches)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                objects=len(self._index),
                memory_bytes=self._mem_used,
                disk_bytes=self._disk_used,
                capacity_bytes=self._mem_cap + self._disk_cap,
                **self._counts,
            )

    def close(self) -> None:
        """Stop the sweeper and end all watches. Disk objects stay for the next run; memory objects are dropped."""
        self._sweeper.stop()
        with self._lock:
            self._closed = True
            self._watches.clear()
            for entry in self._index.values():
                self._release_memory(entry)
            self._index.clear()
            self._mem_used = 0

    def purge_expired(self) -> int:
        """Remove every expired object now (deleting its disk file); return how many."""
        with self._lock:
            return self._purge_expired_locked(self._clock())

    def __enter__(self) -> EmbeddedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the embedded store is closed; open a new EmbeddedStore")

    def _live_entry(self, tenant: str, key: str) -> _Entry | None:
        entry = self._index.get((tenant, key))
        if entry is not None and entry.expires_at <= self._clock():
            self._drop_locked((tenant, key))
            self._counts["expirations"] += 1
            return None
        return entry

    def _purge_expired_locked(self, now: float) -> int:
        purged = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, tenant, key = heapq.heappop(self._expiry)
            entry = self._index.get((tenant, key))
            if entry is not None and entry.seq == seq:  # skip heap items of replaced/deleted versions
                self._drop_locked((tenant, key))
                self._counts["expirations"] += 1
                purged += 1
        return purged

    def _drop_locked(self, ident: tuple[str, str]) -> None:
        entry = self._index.pop(ident, None)
        if entry is None:
            return
        if entry.data is not None:
            self._mem_used -= entry.size
            self._release_memory(entry)
        if entry.path is not None:
            self._disk_used -= entry.size
            self._remove_file(entry.path)
            entry.path = None

    def _make_room_in_memory(self, size: int) -> None:
        while self._mem_used + size > self._mem_cap:
            victim = next(e for e in self._index.values() if e.data is not None)
            payload = victim.data
            assert payload is not None
            if victim.size <= self._disk_cap:
                self._make_room_on_disk(victim.size)
                self._write_disk(victim, payload)
                self._release_memory(victim)
                self._mem_used -= victim.size
            else:
                self._drop_locked((victim.tenant, victim.key))
                self._counts["evictions"] += 1

    def _release_memory(self, entry: _Entry) -> None:
        if entry.data is not None and self._secure_delete:
            self._counts["wiped_bytes"] += wipe(entry.data)
        entry.data = None

    def _make_room_on_disk(self, size: int) -> None:
        while self._disk_used + size > self._disk_cap:
            victim = next(e for e in self._index.values() if e.path is not None)
            self._drop_locked((victim.tenant, victim.key))
            self._counts["evictions"] += 1

    def _file_for(self, tenant: str, key: str) -> Path:
        assert self._disk_dir is not None
        digest = hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()
        return self._disk_dir / f"{digest}{_SUFFIX}"

    def _write_disk(self, entry: _Entry, payload: bytes | bytearray | memoryview) -> None:
        path = self._file_for(entry.tenant, entry.key)
        header = json.dumps(
            {"tenant": entry.tenant, "key": entry.key, "size": entry.size, "expires_at": entry.expires_at}
        ).encode()
        tmp = path.with_suffix(_TMP_SUFFIX)
        try:
            # owner-only: KV holds users' context (M5.9)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(MAGIC + struct.pack(">I", len(header)) + header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {entry.key!r} to the disk tier {self._disk_dir}: {exc}") from exc
        entry.path = path
        self._disk_used += entry.size

    def _read_disk(self, entry: _Entry) -> bytes:
        assert entry.path is not None
        try:
            with open(entry.path, "rb") as f:
                _read_header(f)
                data = f.read()
        except (OSError, ValueError) as exc:
            raise StoreError(f"disk tier file {entry.path} of {entry.key!r} is unreadable: {exc}") from exc
        if len(data) != entry.size:
            raise StoreError(f"disk tier file {entry.path} of {entry.key!r} is truncated")
        return data

    def _remove_file(self, path: Path) -> None:
        try:
            if self._secure_delete:
                remaining = path.stat().st_size
                with open(path, "r+b") as f:
                    while remaining > 0:
                        n = f.write(_ZERO_CHUNK[: min(remaining, len(_ZERO_CHUNK))])
                        remaining -= n
                        self._counts["wiped_bytes"] += n
                    # Without the sync the zeros may only reach the page cache, which unlink then
                    # discards: the old blocks on disk would keep the object.
                    f.flush()
                    os.fsync(f.fileno())
            path.unlink()
        except FileNotFoundError:
            pass

    def _load_disk(self) -> None:
        """Index the objects an earlier run left on disk, oldest first; delete expired and broken ones."""
        assert self._disk_dir is not None
        now = self._clock()
        for tmp in self._disk_dir.glob(f"*{_TMP_SUFFIX}"):
            self._remove_file(tmp)
        files = sorted(self._disk_dir.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                with open(path, "rb") as f:
                    header = _read_header(f)
                size = int(header["size"])
                tenant, key, expires_at = (
                    str(header["tenant"]),
                    str(header["key"]),
                    float(header["expires_at"]),
                )
                ok = path.stat().st_size >= size and path == self._file_for(tenant, key)
            except (OSError, ValueError, KeyError, TypeError):
                ok = False
            if not ok or expires_at <= now or self._disk_used + size > self._disk_cap:
                self._remove_file(path)
                continue
            entry = _Entry(tenant, key, size, expires_at, next(self._seq), path=path)
            self._index[(tenant, key)] = entry
            self._disk_used += size
            heapq.heappush(self._expiry, (expires_at, entry.seq, tenant, key))



def _read_header(f) -> dict:  # noqa: ANN001 - a binary file object
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a crossfill KV store file (bad magic)")
    (length,) = struct.unpack(">I", f.read(4))
    if length > 1 << 16:
        raise ValueError("header too long")
    return json.loads(f.read(length))
