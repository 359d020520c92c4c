"""Sub-commands of the engine package: `crossfill version` (and `generate`, added by the engine)."""

from __future__ import annotations

import typer

import crossfill


def register(app: typer.Typer) -> None:
    @app.command()
    def version() -> None:
        """Print crossfill's version."""
        typer.echo(crossfill.__version__)
