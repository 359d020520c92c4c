"""API keys: who a caller is (tenant) and whether it may call the admin endpoints.

A key is a random secret ("cf-" + 43 URL-safe characters, 256 bits) shown once, when `crossfill
keys add` makes it. Only its SHA-256 is stored, in a JSON-lines keys file
(`security.auth.keys_file`), one line per key:
`{"tenant", "key_sha256", "admin", "created", "key_id"}`. A stolen keys file therefore does not
let anyone call the API. `key_id` (the first 12 hex digits of the hash) names a key to people:
in `keys list`, `keys revoke KEY_ID` and audit records; it cannot be turned back into the key.

Dev keys written in the config (`security.auth.dev_keys`) are hashed in memory and behave the same.
The keys file is read again whenever it changes on disk, so a key added or revoked works at once
in every running service, without a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from crossfill.config import ConfigError, CrossfillConfig

KEY_PREFIX = "cf-"
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")  # as security.auth.dev_keys[].tenant
_KEY_ID_LEN = 12


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(digest: str) -> str:
    """The short public name of a key, from its hash (safe to log: it reveals nothing of the key)."""
    return digest[:_KEY_ID_LEN]


@dataclass(frozen=True)
class KeyRecord:
    tenant: str
    key_sha256: str
    admin: bool
    created: str  # ISO 8601, UTC
    key_id: str

    def to_line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"


@dataclass(frozen=True)
class Identity:
    """The authenticated caller: everything downstream uses this tenant, never the request body's."""

    tenant: str
    admin: bool
    key_id: str


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------- the keys file


def read_keys_file(path: Path) -> list[KeyRecord]:
    """Every key in `path` ([] when the file does not exist); a malformed line is a ConfigError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"security.auth.keys_file: cannot read {str(path)!r} ({exc.strerror or exc})") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            rec = KeyRecord(tenant=str(d["tenant"]), key_sha256=str(d["key_sha256"]).lower(), admin=bool(d["admin"]),
                            created=str(d.get("created", "")), key_id=str(d.get("key_id") or key_id(d["key_sha256"])))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"security.auth.keys_file: {str(path)!r} line {n} is not a key record "
                              "(expected JSON with tenant, key_sha256, admin)") from None
        if not re.fullmatch(r"[0-9a-f]{64}", rec.key_sha256):
            raise ConfigError(f"security.auth.keys_file: {str(path)!r} line {n}: key_sha256 is not a SHA-256 hex digest")
        out.append(rec)
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise writers of one keys file (two `keys add` at once must not lose a line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_key(path: Path, tenant: str, admin: bool = False) -> tuple[str, KeyRecord]:
    """Make a key for `tenant`, append its hash to `path`; returns (the key, shown once, its record)."""
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ConfigError(f"tenant {tenant!r}: 1 to 128 characters of letters, digits, '.', '_' or '-'")
    key = new_key()
    digest = hash_key(key)
    rec = KeyRecord(tenant=tenant, key_sha256=digest, admin=admin, created=_now_iso(), key_id=key_id(digest))
    with _locked(path):
        # The file holds hashes only, but who may call the API is still nobody else's business.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(rec.to_line())
    return key, rec


def revoke_key(path: Path, kid: str) -> KeyRecord:
    """Remove the key named `kid` (its key_id, or a unique prefix of it) from `path`; returns it."""
    with _locked(path):
        records = read_keys_file(path)
        hits = [r for r in records if r.key_id.startswith(kid)] if kid else []
        if len(hits) != 1:
            known = ", ".join(r.key_id for r in records) or "none"
            what = "no key" if not hits else f"{len(hits)} keys"
            raise ConfigError(f"{what} with key_id {kid!r} in {str(path)!r} (known: {known})")
        keep = [r for r in records if r is not hits[0]]
        # Written aside and renamed: a service reading the file sees the old or the new list, never half.
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(r.to_line() for r in keep)
        os.replace(tmp, path)
    return hits[0]


# --------------------------------------------------------------------------- the store


class KeyStore:
    """Dev keys from the config plus the keys file, looked up by the presented key's hash."""

    def __init__(self, dev: list[KeyRecord], keys_file: Path | None) -> None:
        self._dev = dev
        self.keys_file = keys_file
        self._file_keys: list[KeyRecord] = []
        self._seen: tuple[int, int, int] | None = None
        self._reload()

    @classmethod
    def from_config(cls, cfg: CrossfillConfig) -> KeyStore:
        auth = cfg.security.auth
        dev = []
        for k in auth.dev_keys:
            digest = hash_key(k.key)
            dev.append(KeyRecord(tenant=k.tenant, key_sha256=digest, admin=k.admin, created="config", key_id=key_id(digest)))
        path = Path(auth.keys_file).expanduser() if auth.keys_file else None
        store = cls(dev, path)
        if auth.enabled and not store.records():
            where = f" ({str(path)!r} has no key)" if path is not None else ""
            raise ConfigError(
                f"security.auth: authentication is on but no API key is configured{where}; add "
                "`security.auth.dev_keys` (for demos) or `keys_file` (`crossfill keys add TENANT --keys-file F`), "
                "or run with `--no-auth`")
        return store

    def _reload(self) -> None:
        """Read the keys file again if it changed since the last read (size, mtime or inode)."""
        if self.keys_file is None:
            return
        try:
            st = self.keys_file.stat()
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            sig = (0, 0, 0)
        if sig != self._seen:
            self._file_keys = read_keys_file(self.keys_file)
            self._seen = sig

    def records(self) -> list[KeyRecord]:
        self._reload()
        return [*self._dev, *self._file_keys]

    def lookup(self, presented: str) -> Identity | None:
        """The identity of `presented`, or None when it is no valid key."""
        try:
            self._reload()
        except ConfigError:
            # A keys file broken mid-edit must not lock everyone out: keep the last good list.
            pass
        digest = hash_key(presented)
        found: KeyRecord | None = None
        # Every record compared in constant time, no early exit: how long a refusal takes says
        # nothing about how close a guess came (the hash already hides that; this is belt and braces).
        for rec in (*self._dev, *self._file_keys):
            if hmac.compare_digest(rec.key_sha256, digest) and found is None:
                found = rec
        return None if found is None else Identity(found.tenant, found.admin, found.key_id)


def client_api_key(cfg: CrossfillConfig, admin: bool = False) -> str | None:
    """The key a client inside the repo sends (chaos, soak, measure-ttft): the first dev key (an admin one
    when `admin`), or None when authentication is off or the config holds no usable dev key."""
    auth = cfg.security.auth
    if not auth.enabled:
        return None
    for k in auth.dev_keys:
        if k.admin or not admin:
            return k.key
    return None
