"""Signed transfer tickets: the scheduler's permission for one request's KV to move.

The scheduler signs a ticket with every route; prefill computes and sends, and decode accepts,
KV only under a ticket that binds the request (every cache id of an attempt is
`request_id + "." + suffix`), the tenant, the decode instance and the prefill instances the route
allows (its choice and its fallbacks), until an expiry. So a cluster member that can reach a
prefill or a decode port cannot make prefill compute for a job the scheduler never routed, nor
push KV into a cache id of another request, tenant or decode instance.

Encoding (compact, URL-safe, no padding):

    base64url(JSON payload) "." base64url(HMAC-SHA256(key, "crossfill-ticket-v1." + first part))

payload: {"v": 1, "kid", "rid" (request id), "ten" (tenant, "" when none), "dec" (decode
instance), "pre" (allowed prefill instances), "exp" (unix seconds), "non" (random nonce)}.

Keys live in `security.dir`/tickets.json: {"current": kid, "keys": {kid: hex}}. Signing uses
"current"; verifying accepts any key in the file, and the file is read again when it changes, so a
rotation is: add a key and make it current (every process picks it up at its next ticket), then
drop the old key once `security.tickets.ttl_s` has passed (`add_key`, `set_current`, `drop_key`).

A `TicketVerifier` also keeps a replay cache: the same (nonce, cache id) twice is refused, and so
is a nonce presented for more distinct cache ids than the route can legitimately need
(len(prefills) * (kv_cache.max_retry + 1) attempts). Entries leave the cache when their ticket
expires. Every refusal is a `TicketRefused` with one of REASONS, which the services count.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crossfill.config import ConfigError
from crossfill.security.paths import TICKET_KEYS, read_secret_file, write_private

log = logging.getLogger("crossfill.tickets")

VERSION = 1
_DOMAIN = b"crossfill-ticket-v1."  # the MAC covers this prefix too: a ticket MAC is never valid elsewhere
MAX_TICKET_LEN = 4096  # more than any route needs; bounds what a peer can make us parse
MIN_KEY_BYTES = 16
REASONS = ("missing", "malformed", "bad_signature", "unknown_key", "expired", "wrong_tenant", "wrong_decode",
           "wrong_prefill", "wrong_cache_id", "replayed")
Clock = Callable[[], float]


class TicketRefused(Exception):  # noqa: N818 - a refusal with a reason, as WireError
    """A ticket that does not permit what it was presented for; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Ticket:
    kid: str
    request_id: str
    tenant: str
    decode: str
    prefills: tuple[str, ...]
    expires_at: float
    nonce: str


# --------------------------------------------------------------------------- keys


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


_B64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _unb64(text: str) -> bytes:
    # b64decode skips characters outside the alphabet; a ticket with any is malformed, not "close enough".
    if not text or not _B64URL.issuperset(text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def parse_keys(data: bytes, where: str) -> tuple[str, dict[str, bytes]]:
    """(current kid, {kid: key}) from tickets.json; ConfigError naming the file and the problem."""
    try:
        doc = json.loads(data)
        current, raw = doc["current"], doc["keys"]
        if not isinstance(current, str) or not isinstance(raw, dict):
            raise TypeError("\"current\" must be a string and \"keys\" an object")
        keys = {str(kid): bytes.fromhex(value) for kid, value in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"security.dir: the ticket keys {where!r} are not {{\"current\": kid, \"keys\": "
                          f"{{kid: hex}}}} ({type(exc).__name__}: {exc})") from None
    if current not in keys:
        raise ConfigError(f"security.dir: the ticket keys {where!r} name current key {current!r}, "
                          f"which is not among its keys ({sorted(keys)})")
    short = [kid for kid, k in keys.items() if len(k) < MIN_KEY_BYTES]
    if short:
        raise ConfigError(f"security.dir: ticket keys {short} in {where!r} are shorter than {MIN_KEY_BYTES} bytes")
    return current, keys


class TicketKeys:
    """The signing keys of tickets.json, read again whenever the file changes (rotation).

    A change is seen at once through the file's stat, and within RECHECK_S in any case: a rewrite
    can keep size and timestamp (coarse clocks) and even reuse the inode number.
    """

    RECHECK_S = 1.0

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raw = read_secret_file(path, "ticket signing keys")
        self.current, self.keys = parse_keys(self._raw, str(path))
        self._stamp = self._stat()
        self._read_at = time.monotonic()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def refresh(self) -> None:
        """Pick up a rotated file; a file that went missing or broken keeps the keys we have (logged)."""
        stamp = self._stat()
        if stamp is None or (stamp == self._stamp and time.monotonic() - self._read_at < self.RECHECK_S):
            return
        self._stamp, self._read_at = stamp, time.monotonic()
        try:
            raw = self.path.read_bytes()
        except OSError:
            return  # replaced between the stat and the read: the next call sees the new file
        if raw == self._raw:
            return
        self._raw = raw  # a broken file is reported once, not at every ticket
        try:
            self.current, self.keys = parse_keys(raw, str(self.path))
        except ConfigError as exc:
            log.error("ticket keys %s changed but cannot be used (%s); keeping the keys loaded before",
                      self.path, exc)
            return
        log.warning("ticket keys %s reloaded: current key %s, %d key(s) accepted", self.path, self.current,
                    len(self.keys))

    def signing_key(self) -> tuple[str, bytes]:
        self.refresh()
        return self.current, self.keys[self.current]

    def key(self, kid: str) -> bytes | None:
        self.refresh()
        return self.keys.get(kid)


def _read(directory: Path) -> tuple[Path, str, dict[str, bytes]]:
    path = directory / TICKET_KEYS
    current, keys = parse_keys(read_secret_file(path, "ticket signing keys"), str(path))
    return path, current, keys


def _write(path: Path, current: str, keys: dict[str, bytes]) -> None:
    write_private(path, json.dumps({"current": current, "keys": {k: v.hex() for k, v in keys.items()}}).encode())


def list_keys(directory: Path) -> tuple[str, list[str]]:
    """(current key id, every key id) of `directory`/tickets.json."""
    _, current, keys = _read(directory)
    return current, sorted(keys)


def add_key(directory: Path, *, current: bool = True) -> str:
    """Rotation, step 1: a new random key in `directory`/tickets.json; returns its id.

    `current=False` only adds it (verifiers accept it, nothing signs with it yet): on several
    hosts, copy the file everywhere first, then `set_current` where the scheduler runs.
    """
    path, cur, keys = _read(directory)
    kid = secrets.token_hex(4)
    while kid in keys:
        kid = secrets.token_hex(4)
    keys[kid] = secrets.token_bytes(32)
    _write(path, kid if current else cur, keys)
    return kid


def set_current(directory: Path, kid: str) -> None:
    """Rotation, step 2 (several hosts): sign with `kid` from now on."""
    path, _, keys = _read(directory)
    if kid not in keys:
        raise ConfigError(f"security.dir: no ticket key {kid!r} in {str(path)!r} (keys: {sorted(keys)})")
    _write(path, kid, keys)


def drop_key(directory: Path, kid: str) -> None:
    """Rotation, last step (after ttl_s): tickets signed with `kid` stop verifying. The current key stays."""
    path, current, keys = _read(directory)
    if kid == current:
        raise ConfigError(f"security.dir: {kid!r} is the current ticket key; make another one current first")
    if keys.pop(kid, None) is None:
        raise ConfigError(f"security.dir: no ticket key {kid!r} in {str(path)!r} (keys: {sorted(keys)})")
    _write(path, current, keys)


# --------------------------------------------------------------------------- signing


def _mac(key: bytes, body: str) -> bytes:
    return hmac.new(key, _DOMAIN + body.encode("ascii"), hashlib.sha256).digest()


class TicketSigner:
    """The scheduler's half: one ticket per route."""

    def __init__(self, keys: TicketKeys, ttl_s: float, clock: Clock = time.time) -> None:
        self.keys, self.ttl_s, self.clock = keys, ttl_s, clock

    def sign(self, *, request_id: str, tenant: str, decode: str, prefills: Sequence[str]) -> str:
        kid, key = self.keys.signing_key()
        payload = {"v": VERSION, "kid": kid, "rid": request_id, "ten": tenant, "dec": decode,
                   "pre": list(dict.fromkeys(prefills)), "exp": round(self.clock() + self.ttl_s, 3),
                   "non": secrets.token_hex(16)}
        body = _b64(json.dumps(payload, separators=(",", ":"), sort_keys=True).encode())
        return f"{body}.{_b64(_mac(key, body))}"


# --------------------------------------------------------------------------- verifying


def _str(d: dict[str, Any], name: str) -> str:
    v = d.get(name)
    if not isinstance(v, str):
        raise TicketRefused("malformed", f"field {name!r} is not a string")
    return v


def decode_ticket(token: str | None, keys: TicketKeys) -> Ticket:
    """Parse `token` and check its signature (nothing about what it is presented for)."""
    if not token:
        raise TicketRefused("missing", "no transfer ticket")
    if not isinstance(token, str) or len(token) > MAX_TICKET_LEN or token.count(".") != 1:
        raise TicketRefused("malformed", "a ticket is two base64url parts joined by '.'")
    body, mac_text = token.split(".")
    try:
        payload = json.loads(_unb64(body))
        mac = _unb64(mac_text)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise TicketRefused("malformed", "a ticket part is not base64url JSON") from None
    if not isinstance(payload, dict):
        raise TicketRefused("malformed", "the ticket payload is not a JSON object")
    kid = _str(payload, "kid")
    key = keys.key(kid)
    if key is None:
        raise TicketRefused("unknown_key", f"signed with key {kid[:16]!r}, which is not (or no longer) "
                            "in the ticket keys")
    if not hmac.compare_digest(mac, _mac(key, body)):
        raise TicketRefused("bad_signature", "the ticket's signature does not match its content")
    # Signed by the scheduler from here on: a wrong shape is a bug, still refused by name.
    if payload.get("v") != VERSION:
        raise TicketRefused("malformed", f"ticket version {payload.get('v')!r}, this build reads {VERSION}")
    prefills, exp = payload.get("pre"), payload.get("exp")
    if not isinstance(prefills, list) or not all(isinstance(p, str) for p in prefills):
        raise TicketRefused("malformed", "field 'pre' is not a list of instance names")
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        raise TicketRefused("malformed", "field 'exp' is not unix seconds")
    return Ticket(kid, _str(payload, "rid"), _str(payload, "ten"), _str(payload, "dec"), tuple(prefills),
                  float(exp), _str(payload, "non"))


@dataclass
class _Uses:
    expires_at: float
    cache_ids: set[str] = field(default_factory=set)


class TicketVerifier:
    """A worker's half: checks a ticket against what it is presented for, and remembers its uses."""

    def __init__(self, keys: TicketKeys, max_retry: int, clock: Clock = time.time) -> None:
        self.keys, self.max_retry, self.clock = keys, max_retry, clock
        self._uses: dict[str, _Uses] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, nonce)

    def verify(self, token: str | None, *, tenant: str, decode: str, prefill: str | None = None,
               cache_id: str | None = None) -> Ticket:
        """The ticket, when it permits KV of `cache_id` to move from `prefill` to `decode` for `tenant`.

        With a `cache_id` the use is recorded (a second presentation of the same pair is a replay);
        without one only the ticket itself is checked (decode admitting a job it will fetch KV for).
        """
        t = decode_ticket(token, self.keys)
        now = self.clock()
        if now >= t.expires_at:
            raise TicketRefused("expired", f"the ticket expired {now - t.expires_at:.1f}s ago")
        if t.tenant != tenant:
            raise TicketRefused("wrong_tenant", "the ticket was issued for another tenant")
        if t.decode != decode:
            raise TicketRefused("wrong_decode", f"the ticket sends KV to {t.decode}, not {decode}")
        if prefill is not None and prefill not in t.prefills:
            raise TicketRefused("wrong_prefill", f"the ticket does not allow prefill instance {prefill}")
        if cache_id is not None:
            if not cache_id.startswith(t.request_id + ".") or len(cache_id) == len(t.request_id) + 1:
                raise TicketRefused("wrong_cache_id", f"cache id {cache_id!r} is not one of request "
                                    f"{t.request_id!r}")
            self._use(t, cache_id, now)
        return t

    def _use(self, t: Ticket, cache_id: str, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, nonce = heapq.heappop(self._expiry)
            self._uses.pop(nonce, None)
        uses = self._uses.get(t.nonce)
        if uses is None:
            uses = self._uses[t.nonce] = _Uses(t.expires_at)
            heapq.heappush(self._expiry, (t.expires_at, t.nonce))
        if cache_id in uses.cache_ids:
            raise TicketRefused("replayed", f"the ticket was already used for cache id {cache_id!r}")
        budget = max(len(t.prefills), 1) * (self.max_retry + 1)
        if len(uses.cache_ids) >= budget:
            raise TicketRefused("replayed", f"the ticket was already used for {len(uses.cache_ids)} cache ids, "
                                f"all the attempts its route allows ({budget})")
        uses.cache_ids.add(cache_id)

    def remembered(self) -> int:
        """Tickets in the replay cache (not yet expired)."""
        return len(self._uses)
