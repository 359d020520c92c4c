"""`crossfill audit verify FILE`: check an audit log's hash chain."""

from __future__ import annotations

import typer

audit_app = typer.Typer(help="The hash-chained audit log (security.audit_dir).", no_args_is_help=True)


@audit_app.command("verify")
def verify_cmd(path: str = typer.Argument(..., help="an audit log file, e.g. .crossfill/audit/gateway.jsonl")) -> None:
    """Exit 0 when every line follows the one before it; else name the first line that does not."""
    from crossfill.security.audit import verify

    try:
        v = verify(path)
    except OSError as exc:
        typer.echo(f"cannot read {path!r}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from None
    if v.ok:
        typer.echo(f"ok: {v.lines} lines, head {v.head}")
        return
    typer.echo(f"TAMPERED: {v.problem}; the first {v.lines} lines are intact (head {v.head})", err=True)
    raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(audit_app, name="audit")
