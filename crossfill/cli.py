"""The `crossfill` command.

Each concern owns its sub-commands in its own package (`<package>/commands.py` with a
`register(app)` function), so this file only stitches them together and never grows with them.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    help="crossfill: cross-datacenter prefill/decode disaggregated LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Packages whose `commands.register(app)` adds sub-commands.
_COMMAND_PACKAGES = (
    "crossfill.models",
    "crossfill.engine",
    "crossfill.net",
    "crossfill.planner",
    "crossfill.serving",
    "crossfill.reliability",
    "crossfill.sim",
    "crossfill.security",
    "crossfill.observability",
)

for _package in _COMMAND_PACKAGES:
    importlib.import_module(f"{_package}.commands").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
