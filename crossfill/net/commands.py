"""Sub-commands of this package for the `crossfill` CLI."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's sub-commands to `app` (none yet)."""
