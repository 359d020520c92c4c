"""`crossfill keys add|list|revoke`: API keys in the keys file (`security.auth.keys_file`).

The file is named by `--keys-file F` or taken from a config (`--config C`); with a config whose
`security.audit_dir` is set, every change is an audit record (key_added, key_revoked) in
`keys.jsonl` there, a chain of its own (the running services append to theirs).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from crossfill.config import ConfigError, load_config

if TYPE_CHECKING:
    from crossfill.security.audit import AuditLog

keys_app = typer.Typer(help="API keys per tenant (security.auth.keys_file).", no_args_is_help=True)

_KEYS_FILE = typer.Option(None, "--keys-file", help="the JSON-lines keys file (security.auth.keys_file)")
_CONFIG = typer.Option(None, "--config", "-c", help="take security.auth.keys_file (and audit_dir) from this config")


def _target(keys_file: str | None, config: str | None) -> tuple[Path, AuditLog | None]:
    """(keys file, audit log or None) from the options; exits 2 naming the problem."""
    try:
        if config is not None:
            cfg = load_config(config)
            path = keys_file or cfg.security.auth.keys_file
            if path is None:
                raise ConfigError(f"{config}: security.auth.keys_file is not set; set it or pass --keys-file")
            from crossfill.security.audit import open_audit

            return Path(path).expanduser(), open_audit(cfg, "keys", starting=False)
        if keys_file is None:
            raise ConfigError("name the keys file: --keys-file F, or --config C (its security.auth.keys_file)")
        return Path(keys_file).expanduser(), None
    except (ConfigError, ValueError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


@keys_app.command("add")
def add_cmd(tenant: str = typer.Argument(..., help="the tenant this key authenticates as"),
            admin: bool = typer.Option(False, "--admin", help="may also call the admin endpoints (/v1/admin/...)"),
            keys_file: str | None = _KEYS_FILE, config: str | None = _CONFIG) -> None:
    """Make a new key for TENANT: printed once, only its hash is stored."""
    from crossfill.security.keys import add_key

    path, audit = _target(keys_file, config)
    try:
        key, rec = add_key(path, tenant, admin)
    except (ConfigError, OSError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if audit is not None:
        audit.record("key_added", tenant=tenant, key_id=rec.key_id, admin=admin)
    typer.echo(f"added key {rec.key_id} for tenant {tenant}{' (admin)' if admin else ''} to {path}", err=True)
    typer.echo("the key is shown only now; keep it secret (Authorization: Bearer KEY):", err=True)
    typer.echo(key)  # alone on stdout, so `KEY=$(crossfill keys add ...)` captures just the key


@keys_app.command("list")
def list_cmd(keys_file: str | None = _KEYS_FILE, config: str | None = _CONFIG) -> None:
    """Tenant, key_id, admin and creation time of every key (keys themselves are never stored)."""
    from crossfill.security.keys import read_keys_file

    path, _ = _target(keys_file, config)
    try:
        records = read_keys_file(path)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{'tenant':<24} {'key_id':<14} {'admin':<6} created")
    for r in records:
        typer.echo(f"{r.tenant:<24} {r.key_id:<14} {'yes' if r.admin else 'no':<6} {r.created}")


@keys_app.command("revoke")
def revoke_cmd(kid: str = typer.Argument(..., metavar="KEY_ID", help="the key's key_id (from `keys list`)"),
               keys_file: str | None = _KEYS_FILE, config: str | None = _CONFIG) -> None:
    """Remove a key: running services refuse it as soon as they notice the file changed (next request)."""
    from crossfill.security.keys import revoke_key

    path, audit = _target(keys_file, config)
    try:
        rec = revoke_key(path, kid)
    except (ConfigError, OSError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if audit is not None:
        audit.record("key_revoked", tenant=rec.tenant, key_id=rec.key_id, admin=rec.admin)
    typer.echo(f"revoked key {rec.key_id} of tenant {rec.tenant}")


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
