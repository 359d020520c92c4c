"""Engine sub-commands: `crossfill version`, `crossfill generate`."""

from __future__ import annotations

import sys

import typer

import crossfill


def register(app: typer.Typer) -> None:
    @app.command()
    def version() -> None:
        """Print crossfill's version."""
        typer.echo(crossfill.__version__)

    @app.command()
    def generate(
        prompt: str = typer.Argument(..., help="The prompt text."),
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Model name, HF directory or .gguf"),
        max_tokens: int = typer.Option(64, help="Tokens to generate."),
        temperature: float = typer.Option(0.0, help="0 = greedy."),
        top_p: float = typer.Option(1.0),
        top_k: int = typer.Option(-1),
        seed: int | None = typer.Option(None),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    ) -> None:
        """Generate a completion locally (colocated engine) and print it."""
        from crossfill.engine.llm import LLM
        from crossfill.engine.sampling import SamplingParams

        try:
            params = SamplingParams(
                temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed
            )
            llm = LLM(model)
            if chat:
                out = llm.chat([{"role": "user", "content": prompt}], params)
            else:
                out = llm.generate(prompt, params)[0]
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        sys.stdout.write(out.text + "\n")
