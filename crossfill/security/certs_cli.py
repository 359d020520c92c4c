"""`crossfill certs init | issue | show | ticket-key`: the CA, service certificates and ticket keys of `security.dir`."""

from __future__ import annotations

import datetime
from pathlib import Path

import typer

from crossfill.config import ConfigError

certs_app = typer.Typer(help="Mutual TLS between services: the CA and a certificate per service (security.dir).",
                        no_args_is_help=True)


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(str(exc), err=True)
    return typer.Exit(2)


@certs_app.command("init")
def init_cmd(directory: str = typer.Argument(..., help="the security folder to write (security.dir)"),
             config: str = typer.Option(..., "--config", "-c", help="YAML configuration: which services need certificates"),
             force: bool = typer.Option(False, "--force", help="a new CA and new certificates for every service "
                                        "(rotation; ticket keys and the KV master key are kept)")) -> None:
    """Write the CA, a certificate per service of the config (plus "operator"), ticket keys and the KV master key.

    Files that exist are kept, so running it again only fills what is missing (a new instance).
    """
    from crossfill.config import load_config
    from crossfill.security.pki import init_security_dir

    try:
        cfg = load_config(config)
        written = init_security_dir(cfg, directory, force=force)
    except ConfigError as exc:
        raise _fail(exc) from None
    if written:
        typer.echo("wrote " + ", ".join(str(p) for p in written))
    else:
        typer.echo(f"{directory}: nothing missing")
    typer.echo(f"config: security: {{dir: {directory}}}")
    typer.echo("private keys are 0600; ca.key is needed only to issue certificates: keep it off serving hosts")


@certs_app.command("issue")
def issue_cmd(name: str = typer.Argument(..., help="the service: an instance name (e.g. one added at run time) or operator"),
              config: str = typer.Option(..., "--config", "-c", help="YAML configuration (its security.dir)"),
              host: list[str] = typer.Option([], "--host", help="an address the service is reached at (repeat); "
                                             "127.0.0.1, ::1 and localhost are always included")) -> None:
    """Issue (or re-issue) one service's certificate, signed by the folder's CA."""
    from crossfill.config import load_config
    from crossfill.security.pki import issue

    try:
        cfg = load_config(config)
        cert, key = issue(cfg, name, list(host))
    except ConfigError as exc:
        raise _fail(exc) from None
    typer.echo(f"wrote {cert}, {key}")


@certs_app.command("show")
def show_cmd(directory: str = typer.Argument(..., help="the security folder (security.dir)")) -> None:
    """Subject, SANs and expiry of every certificate in the folder."""
    from crossfill.security.pki import read_certs

    d = Path(directory).expanduser()
    files = sorted(d.glob("*.pem"))
    if not files:
        raise _fail(ConfigError(f"{directory}: no certificates (run `crossfill certs init {directory} --config C`)"))
    now = datetime.datetime.now(datetime.UTC)
    for f in files:
        try:
            infos = read_certs(f)
        except ValueError as exc:
            typer.echo(f"{f.name}: not a PEM certificate ({exc})", err=True)
            continue
        for info in infos:
            left = (info.not_after - now).days
            state = "EXPIRED" if left < 0 else f"{left} days left"
            kind = "CA" if info.is_ca else "cert"
            sans = ", ".join(info.sans) or "-"
            typer.echo(f"{f.name:<24} {kind:<4} {info.subject}  SANs: {sans}  expires {info.not_after:%Y-%m-%d} ({state})")


ticket_app = typer.Typer(help="The transfer tickets' signing keys (security.dir/tickets.json): list and rotate.",
                         no_args_is_help=True)


@ticket_app.command("list")
def ticket_list_cmd(directory: str = typer.Argument(..., help="the security folder (security.dir)")) -> None:
    """The key ids in tickets.json; the one that signs is marked current (keys are never shown)."""
    from crossfill.security.tickets import list_keys

    try:
        current, kids = list_keys(Path(directory).expanduser())
    except ConfigError as exc:
        raise _fail(exc) from None
    for kid in kids:
        typer.echo(f"{kid}{'  current' if kid == current else ''}")


@ticket_app.command("add")
def ticket_add_cmd(directory: str = typer.Argument(..., help="the security folder (security.dir)"),
                   current: bool = typer.Option(True, "--current/--no-current",
                                                help="sign with it at once (one host); --no-current on several "
                                                "hosts: copy the file everywhere, then `use` it")) -> None:
    """Rotation, step 1: a new random signing key; prints its id. Running services pick it up within a second."""
    from crossfill.security.tickets import add_key

    try:
        typer.echo(add_key(Path(directory).expanduser(), current=current))
    except ConfigError as exc:
        raise _fail(exc) from None


@ticket_app.command("use")
def ticket_use_cmd(directory: str = typer.Argument(..., help="the security folder (security.dir)"),
                   kid: str = typer.Argument(..., help="the key id to sign with from now on")) -> None:
    """Rotation, step 2 on several hosts: sign with KID from now on."""
    from crossfill.security.tickets import set_current

    try:
        set_current(Path(directory).expanduser(), kid)
    except ConfigError as exc:
        raise _fail(exc) from None


@ticket_app.command("drop")
def ticket_drop_cmd(directory: str = typer.Argument(..., help="the security folder (security.dir)"),
                    kid: str = typer.Argument(..., help="the old key id (wait security.tickets.ttl_s after the switch)")) -> None:
    """Rotation, last step: tickets signed with KID stop verifying (refused as unknown_key)."""
    from crossfill.security.tickets import drop_key

    try:
        drop_key(Path(directory).expanduser(), kid)
    except ConfigError as exc:
        raise _fail(exc) from None


certs_app.add_typer(ticket_app, name="ticket-key")


def register(app: typer.Typer) -> None:
    app.add_typer(certs_app, name="certs")
