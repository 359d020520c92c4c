"""KV at rest: AES-GCM under a per-tenant key, bound to the object it was written as (M5.9).

Why: store-and-pull lands KV (users' context) where crossfill does not control who reads the
bytes: the embedded store's disk tier, the memory segments a Mooncake Store cluster spreads over
other processes, a decode's store server on the network. Sealed, those bytes are useless without
the master key, and an object read under another tenant, cache id or key (a store bug, a moved
file, a tampered byte) fails to open instead of feeding a decode the wrong KV.

Keys: `security.dir/kv-master.key` holds one or more 32-byte master keys in hex, one per line.
The first line seals; every line opens, which is the rotation window (docs/SECURITY.md: add the
new key as the first line on every instance, restart decode then prefill, drop the old line once
the longest KV TTL has passed). A tenant's key is HKDF-SHA256(master, info=b"crossfill kv v1 " +
tenant), so no two tenants share an AES key and no tenant key reveals the master.

Sealed object (network byte order):

    magic "CFKS" | version u8 (1) | 3 zero bytes | key id (8 bytes) | nonce (12 random bytes)
    | AES-256-GCM ciphertext | 16-byte tag

The key id is the first 8 bytes of SHA-256(master key): it says which master opens the object
without revealing it. The associated data is the whole header plus the length-prefixed tenant,
cache id and object key, so editing the header, or presenting the object under any other name,
fails authentication. Random 96-bit nonces: stay well below 2**32 objects per tenant per master
key (NIST SP 800-38D); rotating the master resets the count.

`AtRest` is what the store transport is given: the cipher (None: `kv_encryption.enabled: false`,
bytes stored as they are) and where quarantines and deletions are counted and audited.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from prometheus_client import CollectorRegistry, Counter

from crossfill.config import ConfigError

if TYPE_CHECKING:
    from crossfill.config import CrossfillConfig
    from crossfill.security.audit import AuditLog

MAGIC = b"CFKS"
VERSION = 1
HEADER = struct.Struct(">4sB3x8s12s")  # magic, version, pad, key id, nonce
TAG_BYTES = 16
OVERHEAD = HEADER.size + TAG_BYTES
KEY_BYTES = 32
_INFO = b"crossfill kv v1 "
# Derived tenant keys kept ready; tenants come from authenticated API keys, so this is a bound
# against a flood of names, not a working-set size.
_MAX_CACHED_TENANTS = 4096


class SealError(Exception):
    """A sealed object that does not open; `reason` is a metric label.

    auth_failed: wrong tenant, cache id or key, or altered bytes (the GCM tag does not verify);
    unknown_key: sealed under a master key this process does not hold; malformed: not a sealed
    object of this version at all.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def key_id(master: bytes) -> bytes:
    return hashlib.sha256(master).digest()[:8]


def tenant_key(master: bytes, tenant: str) -> bytes:
    """The AES-256 key of `tenant` under `master`."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_INFO + tenant.encode()).derive(master)


def _associated_data(header: bytes, tenant: str, cache_id: str, key: str) -> bytes:
    parts = [header]
    for name in (tenant, cache_id, key):
        raw = name.encode()
        parts += [struct.pack(">I", len(raw)), raw]  # length-prefixed: ("ab","c") != ("a","bc")
    return b"".join(parts)


class KVCipher:
    """Seals and opens KV objects; thread-safe (the store transport calls it from worker threads)."""

    def __init__(self, master_keys: Sequence[bytes]) -> None:
        if not master_keys:
            raise ValueError("KVCipher needs at least one master key")
        for k in master_keys:
            if len(k) != KEY_BYTES:
                raise ValueError(f"a KV master key is {KEY_BYTES} bytes, got {len(k)}")
        self._masters = {key_id(k): k for k in master_keys}
        self.key_id = key_id(master_keys[0])
        self._aeads: OrderedDict[tuple[bytes, str], AESGCM] = OrderedDict()
        self._lock = threading.Lock()

    def tenant_aead(self, tenant: str, kid: bytes | None = None) -> AESGCM:
        """The AES-GCM of `tenant` under master `kid` (default: the sealing one)."""
        kid = kid or self.key_id
        with self._lock:
            aead = self._aeads.get((kid, tenant))
            if aead is not None:
                self._aeads.move_to_end((kid, tenant))
                return aead
        master = self._masters.get(kid)
        if master is None:
            raise SealError("unknown_key", f"sealed under master key id {kid.hex()}, which this process "
                                           "does not hold (rotated out, or another deployment's object)")
        aead = AESGCM(tenant_key(master, tenant))
        with self._lock:
            self._aeads[(kid, tenant)] = aead
            while len(self._aeads) > _MAX_CACHED_TENANTS:
                self._aeads.popitem(last=False)
        return aead

    def seal(self, data: bytes | bytearray | memoryview, *, tenant: str, cache_id: str, key: str) -> bytearray:
        """The sealed object: a new buffer, written once (no header + body concatenation of a large frame)."""
        header = HEADER.pack(MAGIC, VERSION, self.key_id, os.urandom(12))
        out = bytearray(HEADER.size + memoryview(data).nbytes + TAG_BYTES)
        out[: HEADER.size] = header
        self.tenant_aead(tenant).encrypt_into(header[-12:], data, _associated_data(header, tenant, cache_id, key),
                                              memoryview(out)[HEADER.size :])
        return out

    def open(self, blob: bytes | bytearray | memoryview, *, tenant: str, cache_id: str, key: str) -> bytes:
        """The plaintext, or SealError; never returns bytes that did not authenticate."""
        view = memoryview(blob)
        if len(view) < OVERHEAD:
            raise SealError("malformed", f"{len(view)} bytes is shorter than a sealed object's {OVERHEAD}")
        header = bytes(view[: HEADER.size])
        magic, version, kid, nonce = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise SealError("malformed", f"not a sealed KV object of version {VERSION} "
                                         f"(magic {magic!r}, version {version}); is kv_encryption on "
                                         "on the writer too?")
        try:
            return self.tenant_aead(tenant, kid).decrypt(nonce, view[HEADER.size :],
                                                         _associated_data(header, tenant, cache_id, key))
        except InvalidTag as exc:
            raise SealError("auth_failed", "the object does not authenticate under this tenant, cache id "
                                           "and key (another tenant's or another cache's object, or "
                                           "altered bytes)") from exc


def parse_master_keys(text: bytes, where: str) -> list[bytes]:
    """The keys of a master key file: hex, one per line, blank lines and '#' comments ignored."""
    keys = []
    for n, raw in enumerate(text.decode("ascii", "replace").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            key = bytes.fromhex(line)
        except ValueError:
            key = b""
        if len(key) != KEY_BYTES:
            raise ConfigError(f"security.dir: {where} line {n} is not a {KEY_BYTES}-byte key in hex "
                              f"({2 * KEY_BYTES} hex digits)")
        keys.append(key)
    if not keys:
        raise ConfigError(f"security.dir: {where} holds no key; run `crossfill certs init` (or `crossfill up`)")
    return keys


def load_cipher(cfg: CrossfillConfig) -> KVCipher | None:
    """The deployment's cipher, or None when security.kv_encryption.enabled is false."""
    if not cfg.security.kv_encryption.enabled:
        return None
    from crossfill.security.paths import kv_master_key_path, read_secret_file

    path = kv_master_key_path(cfg)
    return KVCipher(parse_master_keys(read_secret_file(path, "KV master key"), repr(str(path))))


@dataclass
class AtRest:
    """What the store transport needs for KV at rest: the cipher and where events are reported.

    Quarantine (`quarantined`): a stored object failed verification (does not open, or its bytes
    fail the transfer's checks); the puller has already removed it. Deletions (`deleted`): every
    object a transfer removes is counted by why; only deletions that end a cache early (an aborted
    upload, a failed pull) are audited as `cache_deleted`, one line per cache, so the audit log
    does not grow by a line per request. Expiry and eviction are counted by the stores themselves.
    """

    cipher: KVCipher | None = None
    # The process's metrics registry; default: one of its own (tests, benchmarks read it).
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    audit: AuditLog | None = None
    quarantine_counter: Counter = field(init=False)
    delete_counter: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.quarantine_counter = Counter("crossfill_kv_quarantined", "Stored KV objects that failed "
                                          "verification and were removed, by reason", ["reason"], registry=r)
        self.delete_counter = Counter("crossfill_kv_deleted_objects", "Stored KV objects removed by the store "
                                      "transport, by why (consumed, aborted, failed)", ["why"], registry=r)

    def seal(self, data: bytes, *, tenant: str, cache_id: str, key: str) -> bytes | bytearray:
        if self.cipher is None:
            return data
        return self.cipher.seal(data, tenant=tenant, cache_id=cache_id, key=key)

    def open(self, blob: bytes, *, tenant: str, cache_id: str, key: str) -> bytes:
        if self.cipher is None:
            return blob
        return self.cipher.open(blob, tenant=tenant, cache_id=cache_id, key=key)

    def quarantined(self, reason: str, *, tenant: str, cache_id: str, key: str) -> None:
        self.quarantine_counter.labels(reason).inc()
        if self.audit is not None:
            self.audit.record("kv_quarantined", reason=reason, tenant=tenant, cache_id=cache_id, key=key)

    def deleted(self, why: str, *, tenant: str, cache_id: str, objects: int) -> None:
        self.delete_counter.labels(why).inc(objects)
        if why != "consumed" and objects and self.audit is not None:
            self.audit.record("cache_deleted", why=why, tenant=tenant, cache_id=cache_id, objects=objects)

    def quarantines(self, reason: str) -> float:
        return self.registry.get_sample_value("crossfill_kv_quarantined_total", {"reason": reason}) or 0.0

    def deletions(self, why: str) -> float:
        return self.registry.get_sample_value("crossfill_kv_deleted_objects_total", {"why": why}) or 0.0
