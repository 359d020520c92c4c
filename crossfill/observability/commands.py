"""Sub-commands of the observability package: `crossfill diagnose`, `crossfill prometheus-config`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def diagnose(
        config: str | None = typer.Option(None, "--config", "-c", help="the cluster's YAML config: read every service"),
        url: str | None = typer.Option(None, help="a gateway's URL: read its /metrics only"),
        window: float = typer.Option(5.0, min=0, help="seconds between the two readings counters are compared "
                                     "over (0: one reading, counters since each process started)"),
        baseline: str | None = typer.Option(None, help="compare with a snapshot saved earlier by --save "
                                            "instead of waiting --window"),
        save: str | None = typer.Option(None, help="write the snapshot taken now to this file"),
        as_json: bool = typer.Option(False, "--json", help="findings as JSON"),
        api_key: str | None = typer.Option(None, "--api-key", envvar="CROSSFILL_API_KEY",
                                           help="admin API key for the scheduler (default: the config's first "
                                           "admin dev key)"),
    ) -> None:
        """Apply M8's troubleshooting table to a running cluster: findings with evidence and fixes.

        Exit status 0 when healthy, 1 with findings, 2 when nothing could be read."""
        from crossfill.observability.diagnose import run_diagnose

        raise typer.Exit(run_diagnose(config, url, window, baseline, save, as_json, api_key))

    @app.command("prometheus-config")
    def prometheus_config(
        config: str = typer.Option(..., "--config", "-c", help="YAML configuration file"),
        out: str | None = typer.Option(None, help="write here (file paths in it relative to its folder); "
                                       "default: print"),
    ) -> None:
        """A Prometheus scrape config for every service of the deployment (mutual TLS included)."""
        from pathlib import Path

        from crossfill.config import ConfigError, load_config
        from crossfill.observability.prometheus_config import render

        try:
            cfg = load_config(config)
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        if out is None:
            typer.echo(render(cfg, config), nl=False)
            return
        Path(out).write_text(render(cfg, config, Path(out).parent))
        typer.echo(f"wrote {out}")
