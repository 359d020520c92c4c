"""Where the deployment's secrets live inside `security.dir`, and the symmetric keys among them.

One folder holds everything a cluster needs to trust itself: the CA and a certificate per
service (crossfill.security.pki), the ticket signing keys (crossfill.security.tickets) and the
KV master key (crossfill.security.kv_crypto). `crossfill certs init DIR` writes it; every
process of the deployment reads the files it needs from it.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from crossfill.config import ConfigError, CrossfillConfig

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
TICKET_KEYS = "tickets.json"
KV_MASTER_KEY = "kv-master.key"
# A client certificate for people and tools outside the cluster (admin CLI, tests, probes).
OPERATOR = "operator"


def security_dir(cfg: CrossfillConfig) -> Path:
    return Path(cfg.security.dir).expanduser()


def ca_path(cfg: CrossfillConfig) -> Path:
    return security_dir(cfg) / CA_CERT


def cert_paths(cfg: CrossfillConfig, service: str) -> tuple[Path, Path]:
    """(certificate, private key) of `service`: "gateway", "scheduler", an instance name or OPERATOR."""
    d = security_dir(cfg)
    return d / f"{service}.pem", d / f"{service}.key"


def ticket_keys_path(cfg: CrossfillConfig) -> Path:
    return security_dir(cfg) / TICKET_KEYS


def kv_master_key_path(cfg: CrossfillConfig) -> Path:
    return security_dir(cfg) / KV_MASTER_KEY


def write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only (created 0600, never world-readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ensure_symmetric_keys(directory: Path) -> list[Path]:
    """Create the ticket signing keys and the KV master key where missing; returns what was written."""
    written = []
    tickets = directory / TICKET_KEYS
    if not tickets.exists():
        kid = secrets.token_hex(4)
        write_private(tickets, json.dumps({"current": kid, "keys": {kid: secrets.token_hex(32)}}).encode())
        written.append(tickets)
    master = directory / KV_MASTER_KEY
    if not master.exists():
        write_private(master, secrets.token_hex(32).encode())
        written.append(master)
    return written


def read_secret_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"security.dir: cannot read the {what} {str(path)!r} ({exc.strerror or exc}); "
                          "run `crossfill certs init` for this config (or `crossfill up`, which does)") from None
