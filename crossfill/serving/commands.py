"""Sub-commands of the serving package: `crossfill config check`, `crossfill serve ROLE`, `crossfill up`."""

from __future__ import annotations

import typer

from crossfill.config import ROLES, ConfigError, load_config

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


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")

    @app.command()
    def serve(
        role: str = typer.Argument(..., help=f"one of {', '.join(ROLES)}"),
        config: str = typer.Option(..., "--config", "-c", help="YAML configuration file"),
        instance: str | None = typer.Option(None, "--instance", help="instance name (prefill/decode roles)"),
    ) -> None:
        """Run one role of the deployment in this process."""
        from crossfill.serving.run import serve_role

        raise typer.Exit(serve_role(role, config, instance))

    @app.command()
    def up(config: str = typer.Option(..., "--config", "-c", help="YAML configuration file")) -> None:
        """Start the whole topology on this machine: each role its own process, WAN emulators between DCs."""
        from crossfill.serving.up import run_up

        raise typer.Exit(run_up(config))

    @app.command("measure-ttft")
    def measure_ttft(
        config: str = typer.Option(..., "--config", "-c", help="YAML configuration file"),
        url: str | None = typer.Option(None, help="gateway of a running cluster (default: start one from --config)"),
        short_tokens: int = typer.Option(32, help="tokens of the short prompt"),
        long_tokens: int = typer.Option(1024, help="tokens of the long prompt"),
        repeats: int = typer.Option(3, help="requests per cell (the median is shown)"),
    ) -> None:
        """TTFT of local vs remote prefill for a short and a long prompt, split into stages, with KV bytes."""
        from crossfill.serving.measure import run_measure

        raise typer.Exit(run_measure(config, url, short_tokens, long_tokens, repeats))
