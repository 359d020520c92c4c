"""`KVStore` on Mooncake Store, for when store-and-pull outgrows one machine's embedded store.

Mooncake Store keeps objects in memory segments contributed by its clients (`global_segment_bytes`
each) under a `mooncake_master` (see mooncake_master.py); a client stages each put/get through a
local buffer (`local_buffer_bytes`), which therefore bounds the size of one object. Transfers run
on Mooncake's Transfer Engine, over TCP here.

What crossfill adds on top, and why:
- Tenant isolation: keys are stored as `cf/<tenant>/<key>`; tenant ids cannot contain '/', so no
  tenant can name another tenant's key.
- TTL: Mooncake has leases and eviction but no expiry. Every value is stored behind a 16-byte
  header carrying its wall-clock expiry time, so *any* reader (another process, another host)
  refuses an expired object and removes it; the writing client also keeps an expiry index and
  removes what it wrote when it expires (`purge_expired`, or the sweeper thread).
- Replacement: Mooncake's `put` of an existing key keeps the old value, so puts use `upsert`.
- Errors: Mooncake returns negative codes; they become `StoreError`s naming the code and the fix.

At rest: the store transport seals every object before it gets here (crossfill.security.kv_crypto),
so segments only ever hold ciphertext. `remove` frees an object's space but Mooncake does not zero
it, and no client can reach another's segment memory to do so: deletion here means unreachable
plus ciphertext, which the master key rotation finally makes unreadable.

Keep in mind: objects live in the contributing clients' memory, so an object disappears when the
client process that holds its segment exits (run a long-lived store service for durability), and
`stats()` reflects what this client wrote and read, not the whole cluster. Mooncake Store has no
watch/notification API, so this is a plain `KVStore`, not a `WatchableKVStore`: store-and-pull
readers poll it (with backoff) and take a wake-up hint from a control channel instead.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from crossfill.kv.store.base import (
    DEFAULT_TENANT,
    ExpirySweeper,
    InvalidArgumentError,
    ObjectTooLargeError,
    StoreError,
    StoreStats,
    StoreUnavailableError,
    check_names,
    check_ttl,
    guarded,
)

_HEADER = struct.Struct(">4sB3xd")  # magic, version, pad, expires_at (unix seconds)
_MAGIC = b"CFMS"
_VERSION = 1
KEY_PREFIX = "cf"

# Mooncake ErrorCode values seen through the Python API (mooncake-store types.h).
_OBJECT_NOT_FOUND = -704
_CODES = {
    -10: "BUFFER_OVERFLOW",
    -200: "NO_AVAILABLE_HANDLE (the store's memory segments are full)",
    -400: "INVALID_KEY",
    -600: "INVALID_PARAMS (often: the object is larger than local_buffer_bytes)",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (is mooncake_master running and reachable?)",
}


def _check_master_reachable(master_addr: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds, not after the ~90 s of retries Mooncake's setup spends on a dead master."""
    host, sep, port = master_addr.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgumentError(f"master_addr {master_addr!r} is not HOST:PORT of mooncake_master")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise StoreUnavailableError(
            f"cannot reach mooncake_master at {master_addr} ({exc}): start it (crossfill's MooncakeMaster "
            "or the mooncake_master binary) or fix the address"
        ) from exc


def _code(rc: int) -> str:
    return f"{rc} {_CODES.get(rc, 'see mooncake-store ErrorCode')}"


class MooncakeStore:
    """A `KVStore` client of a Mooncake Store cluster.

    Args:
        master_addr: 'HOST:PORT' of mooncake_master.
        local_hostname: this client's address as peers should reach it.
        metadata_server: 'P2PHANDSHAKE' (no metadata service) or an etcd / http metadata URL.
        global_segment_bytes: memory this client contributes to the cluster (0: stores nothing).
        local_buffer_bytes: staging buffer; also the largest object this client can put or get.
        protocol: Mooncake transport; 'tcp' works everywhere, 'rdma' needs RDMA NICs.
        default_ttl_s, sweep_interval_s, clock: as in `EmbeddedStore`.
    """

    def __init__(
        self,
        master_addr: str,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 128 << 20,
        protocol: str = "tcp",
        default_ttl_s: float = 600.0,
        sweep_interval_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreUnavailableError(
                f"Mooncake Store needs the optional 'mooncake' extra ({exc}): "
                "pip install 'crossfill[mooncake]' and the OS package libibverbs1"
            ) from exc
        if local_buffer_bytes <= _HEADER.size:
            raise InvalidArgumentError(
                f"local_buffer_bytes must exceed {_HEADER.size}, got {local_buffer_bytes}"
            )
        check_ttl(default_ttl_s)
        _check_master_reachable(master_addr)
        self.master_addr = master_addr
        self.global_segment_bytes = global_segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self._default_ttl = default_ttl_s
        self._clock = clock
        self._client: Any = MooncakeDistributedStore()
        rc = self._client.setup(
            local_hostname,
            metadata_server,
            global_segment_bytes,
            local_buffer_bytes,
            protocol,
            "",
            master_addr,
        )
        if rc != 0:
            raise StoreUnavailableError(
                f"Mooncake Store setup against master {master_addr} failed with code {rc}: "
                "check that mooncake_master runs there and that the protocol/metadata settings match"
            )
        self._lock = threading.RLock()
        # Scratch buffer to read just an object's header (exists() without moving the payload).
        self._scratch = ctypes.create_string_buffer(_HEADER.size)
        self._scratch_ptr = ctypes.addressof(self._scratch)
        self._scratch_ok = self._client.register_buffer(self._scratch_ptr, _HEADER.size) == 0
        self._written: dict[tuple[str, str], tuple[float, int, int]] = {}  # -> (expires_at, seq, size)
        self._expiry: list[tuple[float, int, str, str]] = []
        self._seq = itertools.count()
        self._counts = dict.fromkeys(("puts", "hits", "misses", "deletes", "evictions", "expirations"), 0)
        self._closed = False
        self._sweeper = ExpirySweeper(self.purge_expired, sweep_interval_s, "mooncake-sweeper")

    # ------------------------------------------------------------------ KVStore API

    def put(self, key: str, data: bytes, ttl_s: float | None = None, tenant: str = DEFAULT_TENANT) -> None:
        check_names(key, tenant)
        check_ttl(ttl_s)
        size = len(data)
        if size + _HEADER.size > self.local_buffer_bytes:
            raise ObjectTooLargeError(
                f"object {key!r} is {size} bytes but this Mooncake client moves at most "
                f"{self.local_buffer_bytes - _HEADER.size} bytes per object (local_buffer_bytes="
                f"{self.local_buffer_bytes}); raise local_buffer_bytes or split the object"
            )
        with self._lock:
            self._check_open()
            now = self._clock()
            self._purge_expired_locked(now)
            expires_at = now + (ttl_s or self._default_ttl)
            header = _HEADER.pack(_MAGIC, _VERSION, expires_at)
            rc = self._client.upsert_parts(self._name(tenant, key), header, data)
            if rc != 0:
                raise StoreError(f"Mooncake put of {key!r} ({size} bytes) failed: {_code(rc)}")
            seq = next(self._seq)
            self._written[(tenant, key)] = (expires_at, seq, size)
            heapq.heappush(self._expiry, (expires_at, seq, tenant, key))
            self._counts["puts"] += 1

    def get(self, key: str, tenant: str = DEFAULT_TENANT) -> bytes | None:
        with guarded(self._lock, self._check_open, key, tenant):
            raw = self._client.get(self._name(tenant, key))
            if not raw:  # Mooncake returns b"" for a missing object; ours are never empty
                self._note_missing(tenant, key)
                return None
            expires_at = self._parse_header(key, raw)
            if expires_at <= self._clock():
                self._expire(tenant, key)
                return None
            self._counts["hits"] += 1
            return raw[_HEADER.size :]

    def delete(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        with guarded(self._lock, self._check_open, key, tenant):
            self._written.pop((tenant, key), None)
            removed = self._remove(tenant, key)
            if removed:
                self._counts["deletes"] += 1
            return removed

    def exists(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        with guarded(self._lock, self._check_open, key, tenant):
            name = self._name(tenant, key)
            if self._scratch_ok:  # read only the header
                (((rc,),),) = self._client.get_into_ranges(
                    [self._scratch_ptr], [[name]], [[[0]]], [[[0]]], [[[_HEADER.size]]]
                )
                if rc < 0:
                    return False
                expires_at = self._parse_header(key, self._scratch.raw)
            else:
                raw = self._client.get(name)
                if not raw:
                    return False
                expires_at = self._parse_header(key, raw)
            if expires_at <= self._clock():
                self._expire(tenant, key)
                return False
            return True

    def stats(self) -> StoreStats:
        """This client's view: objects it wrote that are still live, and its own counters."""
        with self._lock:
            return StoreStats(
                objects=len(self._written),
                memory_bytes=sum(size for _, _, size in self._written.values()),
                disk_bytes=0,
                capacity_bytes=self.global_segment_bytes,
                **self._counts,
            )

    def purge_expired(self) -> int:
        """Remove the objects this client wrote whose TTL has passed; return how many."""
        with self._lock:
            return self._purge_expired_locked(self._clock())

    def close(self) -> None:
        """Stop the sweeper and leave the cluster (this client's segment and its objects go away)."""
        self._sweeper.stop()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._client.close()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _name(tenant: str, key: str) -> str:
        return f"{KEY_PREFIX}/{tenant}/{key}"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the Mooncake store client is closed; open a new MooncakeStore")

    @staticmethod
    def _parse_header(key: str, raw: bytes) -> float:
        if len(raw) < _HEADER.size:
            raise StoreError(f"Mooncake object {key!r} is too short to be a crossfill object")
        magic, version, expires_at = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION:
            raise StoreError(
                f"Mooncake object {key!r} was not written by crossfill's MooncakeStore "
                f"(magic {magic!r}, version {version}); another writer uses the '{KEY_PREFIX}/' namespace?"
            )
        return expires_at

    def _remove(self, tenant: str, key: str) -> bool:
        rc = self._client.remove(self._name(tenant, key), True)  # force: our delete beats read leases
        if rc == 0:
            return True
        if rc == _OBJECT_NOT_FOUND:
            return False
        raise StoreError(f"Mooncake remove of {key!r} failed: {_code(rc)}")

    def _note_missing(self, tenant: str, key: str) -> None:
        self._counts["misses"] += 1
        written = self._written.pop((tenant, key), None)
        if written is not None and written[0] > self._clock():
            self._counts["evictions"] += 1  # we wrote it, it had not expired: Mooncake evicted it

    def _expire(self, tenant: str, key: str) -> None:
        self._counts["misses"] += 1
        self._counts["expirations"] += 1
        self._written.pop((tenant, key), None)
        self._remove(tenant, key)

    def _purge_expired_locked(self, now: float) -> int:
        purged = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, tenant, key = heapq.heappop(self._expiry)
            written = self._written.get((tenant, key))
            if written is not None and written[1] == seq:
                del self._written[(tenant, key)]
                if self._remove(tenant, key):
                    self._counts["expirations"] += 1
                    purged += 1
        return purged

