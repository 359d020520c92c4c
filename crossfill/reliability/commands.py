"""Sub-commands of the reliability package: `crossfill chaos` and `crossfill soak`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def chaos(
        config: str = typer.Option(..., "--config", "-c", help="YAML configuration file of the cluster to start"),
        short: bool = typer.Option(False, "--short", help="quick form: fewer requests, a 3 s partition"),
        scenario: list[str] = typer.Option(None, "--scenario", help="run only this scenario (repeatable)"),
        json_out: str = typer.Option(None, "--json", help="write the rows, with error counts, as JSON here"),
        markdown: str = typer.Option(None, "--markdown", help="write the table as markdown here"),
        out: str = typer.Option("out/chaos", "--out", help="folder for the cluster's log"),
    ) -> None:
        """Start the cluster and run every fault scenario under load; one row per scenario.

        Exit status 1 when any request was lost, duplicated or wrong, or KV blocks leaked.
        """
        from crossfill.reliability.chaos import run_chaos

        raise typer.Exit(run_chaos(config, short, scenario or None, json_out, markdown, out))

    @app.command()
    def soak(
        config: str = typer.Option(..., "--config", "-c", help="YAML configuration file of the cluster to start"),
        minutes: float = typer.Option(10.0, "--minutes", help="how long the load runs"),
        out: str = typer.Option("out/soak", "--out", help="folder for summary.json, the plots and the log"),
        sample_s: float = typer.Option(10.0, "--sample-s", help="seconds between resource samples"),
        fault_every_s: float = typer.Option(None, "--fault-every-s",
                                            help="seconds between faults (default: 180, or a quarter of the run)"),
    ) -> None:
        """Steady mixed load with periodic faults; resource trends (RSS, fds, threads, KV) and request counts.

        Exit status 1 when a trend exceeds its bound or any request was lost, duplicated or wrong.
        """
        from crossfill.reliability.soak import run_soak

        raise typer.Exit(run_soak(config, minutes, out, sample_s, fault_every_s))
