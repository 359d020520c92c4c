"""Sub-commands of the security package: `crossfill keys`, `crossfill certs`, `crossfill audit`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from crossfill.security import audit_cli, certs_cli, keys_cli

    keys_cli.register(app)
    certs_cli.register(app)
    audit_cli.register(app)
