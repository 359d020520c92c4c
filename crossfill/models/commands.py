"""`crossfill models list` and `crossfill models pull NAME [--force]`."""

from __future__ import annotations

import typer


def _size(num: int) -> str:
    return f"{num / 1e6:.0f} MB"


def register(app: typer.Typer) -> None:
    models = typer.Typer(help="Known models and the local model cache.", no_args_is_help=True)
    app.add_typer(models, name="models")

    @models.command("list")
    def list_models() -> None:
        """Show the known models, whether each is in the cache, and where."""
        from rich.console import Console
        from rich.table import Table

        from crossfill.models import known_models

        table = Table(title="crossfill models (also accepted: a Hugging Face directory or a .gguf path)")
        for column in ("name", "architecture", "params", "download", "cached", "path"):
            table.add_column(column)
        for info in known_models():
            table.add_row(info.name, info.architecture, info.params, _size(info.size),
                          "yes" if info.cached else "no", str(info.path))
        Console(width=200).print(table)

    @models.command("pull")
    def pull(
        name: str = typer.Argument(..., help="registry name, Hugging Face directory or .gguf file"),
        force: bool = typer.Option(False, "--force", help="download and dequantise again even if cached"),
    ) -> None:
        """Download, verify and dequantise a model into $CROSSFILL_HOME (default ~/.cache/crossfill)."""
        from crossfill.models import ModelError, resolve_model
        from crossfill.models.files import verify_model

        try:
            files = resolve_model(name, force=force)
            if not force:  # it may have been cached long ago: check it is still intact
                verify_model(files)
        except ModelError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"{files.name}: {files.path} (fingerprint {files.fingerprint[:16]})")
