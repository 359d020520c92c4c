"""Small, fast simulations of the shipped example, with parts of it changed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from crossfill.sim.run import Outcome, simulate
from crossfill.sim.simfile import Overrides, parse_spec

EXAMPLE = Path(__file__).parents[2] / "crossfill" / "sim" / "examples" / "prfaas-case-study.yaml"


def example() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))


def run(data: dict[str, Any] | None = None, requests: int = 400, strategies: tuple[str, ...] | None = None,
        seed: int = 3) -> Outcome:
    spec = parse_spec(data or example(), "test", Overrides(requests=requests, seed=seed, strategies=strategies))
    return simulate(spec)


def by_name(outcome: Outcome) -> dict[str, dict[str, Any]]:
    return {s["strategy"]: s for s in outcome.report["strategies"]}
