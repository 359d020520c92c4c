"""The audit log: append-only, hash-chained JSON lines, one file per service.

Every line carries `prev` (the hash of the line before it, "0"*64 for the first) and `hash`
(SHA-256 over `prev` and the line's canonical JSON without `hash`), so editing, removing or
reordering any line breaks the chain at that point: `crossfill audit verify FILE` finds it. A
cut-off tail leaves a valid shorter chain; the head (`hash` of the last line, printed by verify
and exposed by each service's audit log) shipped elsewhere is what detects that.

Events (`event`): auth_failed, permission_denied, admin_action, key_added, config_loaded,
cache_deleted, ticket_refused, limit_exceeded, kv_quarantined. Fields never include prompt or
output text.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENESIS = "0" * 64


def _digest(prev: str, record: dict[str, Any]) -> str:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256((prev + body).encode()).hexdigest()


class AuditLog:
    """Appends chained records to `path`; continues the chain of a file that already exists."""

    def __init__(self, path: str | Path, service: str) -> None:
        self.path = Path(path)
        self.service = service
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._seq, self.head = _tail(self.path)

    def record(self, event: str, **fields: Any) -> str:
        """Append one event; returns its hash (the new head)."""
        with self._lock:
            rec = {"seq": self._seq + 1, "ts": round(time.time(), 6), "service": self.service, "event": event,
                   **fields, "prev": self.head}
            rec["hash"] = _digest(self.head, rec)
            line = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"
            with self.path.open("a", encoding="ascii") as f:
                f.write(line)
            self._seq, self.head = rec["seq"], rec["hash"]
            return self.head


def _tail(path: Path) -> tuple[int, str]:
    """(seq, hash) of the file's last line, (0, GENESIS) for a new file."""
    if not path.exists() or path.stat().st_size == 0:
        return 0, GENESIS
    last = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        rec = json.loads(last)
        return int(rec["seq"]), str(rec["hash"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"audit log {str(path)!r}: its last line is not an audit record; "
                         f"run `crossfill audit verify {path}` and move the file aside") from None


@dataclass(frozen=True)
class Verdict:
    ok: bool
    lines: int
    head: str
    problem: str | None = None  # the first break, with its line number


def verify(path: str | Path) -> Verdict:
    """Walk the chain from the first line; report the first line that does not follow."""
    prev, seq, n = GENESIS, 0, 0
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                rec = json.loads(raw)
                claimed = rec.pop("hash")
            except (ValueError, KeyError, TypeError, AttributeError):
                return Verdict(False, n - 1, prev, f"line {n}: not an audit record (edited?)")
            if rec.get("prev") != prev:
                return Verdict(False, n - 1, prev, f"line {n}: does not follow line {n - 1} "
                                                   "(a line was removed, inserted or reordered)")
            if rec.get("seq") != seq + 1:
                return Verdict(False, n - 1, prev, f"line {n}: sequence {rec.get('seq')} after {seq}")
            if _digest(prev, rec) != claimed:
                return Verdict(False, n - 1, prev, f"line {n}: its content does not match its hash (edited)")
            prev, seq = claimed, rec["seq"]
    return Verdict(True, n, prev)


def open_audit(cfg: Any, service: str, *, starting: bool = True) -> AuditLog | None:
    """The audit log of `service` under `security.audit_dir` (None when the config turns it off).

    A service opens it once per process (two writers fork the chain) and, with `starting`, records
    `config_loaded`: the config's digest and the security switches it runs with, so turning auth,
    TLS, tickets or encryption off, or changing limits, is itself on the record.
    """
    d = cfg.security.audit_dir
    if d is None:
        return None
    log = AuditLog(Path(d).expanduser() / f"{service}.jsonl", service)
    if starting:
        log.record("config_loaded", **config_fingerprint(cfg))
    return log


def config_fingerprint(cfg: Any) -> dict[str, Any]:
    """The config's SHA-256 (over its canonical JSON) and the security settings in force."""
    dumped = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    sec = cfg.security
    limits = sec.limits.model_dump(mode="json")
    return {
        "config_sha256": hashlib.sha256(dumped.encode()).hexdigest(),
        "auth": sec.auth.enabled, "tls": sec.tls.enabled, "tickets": sec.tickets.enabled,
        "kv_encryption": sec.kv_encryption.enabled,
        "limits_sha256": hashlib.sha256(json.dumps(limits, sort_keys=True).encode()).hexdigest(),
    }
