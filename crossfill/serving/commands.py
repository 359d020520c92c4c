"""Sub-commands of the serving package: `crossfill config check`, `crossfill serve ROLE`, `crossfill up`."""

from __future__ import annotations

import os

import typer

from crossfill.config import ROLES, ConfigError, CrossfillConfig, load_config

config_app = typer.Typer(help="Inspect and validate configuration files.", no_args_is_help=True)


@config_app.command("check")
def config_check(path: str = typer.Argument(..., help="YAML configuration file")) -> None:
    """Validate FILE; print the instances it defines, or every problem with its key path."""
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    svc = cfg.inference_service
    typer.echo(f"{path}: OK (mode {svc.mode}, model {cfg.model.name})")
    for inst in cfg.instances():
        kv = f" kv:{inst.kv_port}" if inst.kv_port else ""
        typer.echo(f"  {inst.name:<24} {inst.role:<9} {inst.datacenter:<12} {inst.host}:{inst.port}{kv}")
    for c in cfg.crossings():
        typer.echo(f"  link emulator {c.listen_host}:{c.listen_port} -> {c.target} {c.kind} "
                   f"{c.target_host}:{c.target_port} (control :{c.control_port})")
    typer.echo(f"  security: {security_summary(cfg)}")


def security_summary(cfg: CrossfillConfig) -> str:
    """One line: which protections this config runs with (docs/SECURITY.md), so a switched-off one shows."""
    sec = cfg.security
    auth = sec.auth
    if auth.enabled:
        keys = [f"keys_file {auth.keys_file}"] if auth.keys_file else []
        keys += [f"{len(auth.dev_keys)} dev key(s)"] if auth.dev_keys else []
        auth_text = f"API keys ({', '.join(keys) or 'none yet: the gateway will refuse to start'})"
    else:
        auth_text = "API keys OFF"
    parts = [auth_text,
             f"mutual TLS from {sec.dir}" if sec.tls.enabled else "mutual TLS OFF",
             f"transfer tickets (ttl {sec.tickets.ttl_s:g} s)" if sec.tickets.enabled else "transfer tickets OFF",
             "KV at rest AES-GCM" if sec.kv_encryption.enabled else "KV at rest in the clear",
             f"audit in {sec.audit_dir}" if sec.audit_dir else "audit OFF"]
    return "; ".join(parts)


pki_app = typer.Typer(help="Certificates for mutual TLS on the KV data plane (kv_cache.tls).", no_args_is_help=True)


@pki_app.command("dev")
def pki_dev(directory: str = typer.Argument(..., help="folder to write ca.pem, server.pem/.key, client.pem/.key"),
            ip: str = typer.Option("127.0.0.1", help="IP address the server certificate is valid for")) -> None:
    """Write a throw-away CA and certificates for a kv_cache.tls demo (never for production).

    Mutual TLS on every hop, the KV data plane included, needs no kv_cache.tls: see `crossfill certs init`."""
    from crossfill.kv.tls import write_dev_pki

    paths = write_dev_pki(directory, ip)
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")
    cert, key, ca = paths["server_cert"], paths["server_key"], paths["ca"]
    typer.echo(f"kv_cache.tls: {{cert_file: {cert}, key_file: {key}, ca_file: {ca}}}")


_NO_AUTH_HELP = "no API keys for this run (security.auth.enabled false): anyone reaching the port is any tenant"


def _no_auth(on: bool) -> None:
    # An environment variable, so every process `up` starts (and restarts) inherits it.
    if on:
        from crossfill.security.auth import NO_AUTH_ENV

        os.environ[NO_AUTH_ENV] = "1"


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
    app.add_typer(pki_app, name="pki")

    @app.command()
    def serve(
        role: str = typer.Argument(..., help=f"one of {', '.join(ROLES)}"),
        config: str = typer.Option(..., "--config", "-c", help="YAML configuration file"),
        instance: str | None = typer.Option(None, "--instance", help="instance name (prefill/decode roles)"),
        datacenter: str | None = typer.Option(None, help="scale out: run an instance the config does not list, "
                                              "in this datacenter (then register it: POST /v1/admin/instances)"),
        port: int | None = typer.Option(None, help="scale out: its HTTP port"),
        kv_port: int | None = typer.Option(None, help="scale out: its KV port (decode)"),
        host: str | None = typer.Option(None, help="scale out: its address (default: the datacenter's host)"),
        no_auth: bool = typer.Option(False, "--no-auth", help=_NO_AUTH_HELP),
    ) -> None:
        """Run one role of the deployment in this process."""
        from crossfill.serving.run import ExtraInstance, serve_role

        _no_auth(no_auth)

        extra = None
        if datacenter is not None or port is not None:
            extra = ExtraInstance(datacenter=datacenter, port=port, kv_port=kv_port, host=host)
        raise typer.Exit(serve_role(role, config, instance, extra))

    @app.command()
    def up(config: str = typer.Option(..., "--config", "-c", help="YAML configuration file"),
           no_auth: bool = typer.Option(False, "--no-auth", help=_NO_AUTH_HELP)) -> None:
        """Start the whole topology on this machine: each role its own process, WAN emulators between DCs."""
        from crossfill.serving.up import run_up

        _no_auth(no_auth)

        raise typer.Exit(run_up(config))

    @app.command("measure-ttft")
    def measure_ttft(
        config: str = typer.Option(..., "--config", "-c", help="YAML configuration file"),
        url: str | None = typer.Option(None, help="gateway of a running cluster (default: start one from --config)"),
        short_tokens: int = typer.Option(32, help="tokens of the short prompt"),
        long_tokens: int = typer.Option(1024, help="tokens of the long prompt"),
        repeats: int = typer.Option(3, help="requests per cell (the median is shown)"),
        api_key: str | None = typer.Option(None, "--api-key", envvar="CROSSFILL_API_KEY",
                                           help="the gateway's API key (default: the config's first dev key)"),
    ) -> None:
        """TTFT of local vs remote prefill for a short and a long prompt, split into stages, with KV bytes."""
        from crossfill.serving.measure import run_measure

        raise typer.Exit(run_measure(config, url, short_tokens, long_tokens, repeats, api_key))
