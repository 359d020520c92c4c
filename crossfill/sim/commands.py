"""`crossfill simulate`: drive the live routing policy through a simulated cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from crossfill.config import ConfigError
from crossfill.planner.commands import json_safe
from crossfill.planner.errors import PlanError
from crossfill.sim.errors import SimError


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        config: Annotated[str, typer.Option("--config", "-c", help="Simulation YAML (a planner cluster file plus "
                                            "workload, link, failures, routing, SLOs).")],
        trace: Annotated[str | None, typer.Option(help="CSV/JSONL trace replacing the synthetic workload.")] = None,
        workload: Annotated[str | None, typer.Option(
            "--workload", "--lengths",
            help="Prompt lengths, as `plan --lengths`: 'lognormal:median=8192,sigma=1,min=128,max=131072' "
                 "or 'empirical:FILE'.")] = None,
        rate: Annotated[float | None, typer.Option(help="Arrival rate, requests/s (overrides arrival.rate).")] = None,
        requests: Annotated[int | None, typer.Option("--requests", "-n", help="Requests to simulate.")] = None,
        seed: Annotated[int | None, typer.Option(help="Random seed (same seed, same arrivals and results).")] = None,
        strategies: Annotated[str | None, typer.Option(
            help="Comma-separated: homogeneous-pd, naive-remote, threshold-only, full-policy.")] = None,
        scale: Annotated[float | None, typer.Option(help="Multiply every pool, the arrival rate and the link bandwidth.")] = None,
        candidates: Annotated[int | None, typer.Option(
            help="Instances sampled per pool for each decision (power-of-k choices).")] = None,
        search_rate: Annotated[bool, typer.Option(
            "--search-rate", help="Find each strategy's highest rate meeting slo.attainment.")] = False,
        out: Annotated[str | None, typer.Option(help="Directory for simulate.json and simulate.png.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    ) -> None:
        """Simulate the routing policy at cluster scale and compare strategies on the same arrivals."""
        from crossfill.sim.run import search_rates
        from crossfill.sim.run import simulate as run_simulation
        from crossfill.sim.simfile import Overrides, load_spec
        from crossfill.sim.trace import load_trace

        try:
            names = tuple(s.strip() for s in strategies.split(",") if s.strip()) if strategies else None
            replay = load_trace(trace) if trace else None
            spec = load_spec(config, Overrides(lengths=workload, rate=rate, requests=requests, seed=seed, scale=scale,
                                               strategies=names, candidates=candidates), replay)
            outcome = search_rates(spec, replay) if search_rate else run_simulation(spec, replay)
            report = json_safe(outcome.report)
            assert isinstance(report, dict)
            if out:
                directory = Path(out)
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                    (directory / "simulate.json").write_text(json.dumps(report, indent=2))
                except OSError as exc:
                    raise SimError(f"--out: cannot write to {directory} ({exc})") from None
                if outcome.results:
                    from crossfill.sim.plots import plot_runs

                    plot_runs(directory / "simulate.png", outcome.results, outcome.report["strategies"],
                              spec.slo.ttft_s)
        except (SimError, PlanError, ConfigError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        if as_json:
            typer.echo(json.dumps(report, indent=2))
        else:
            from rich.console import Console

            from crossfill.sim.report import render

            render(outcome.report, Console(width=200))
