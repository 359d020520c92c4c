"""Strict readers for the simulation file: each names the key path it refuses and what it expects."""

from __future__ import annotations

from typing import Any

from crossfill.sim.errors import SimError

MISSING = object()


def mapping(raw: Any, path: str, allowed: set[str] | None, *, required: bool = False) -> dict[str, Any]:
    if raw is None:
        if required:
            raise SimError(f"{path}: missing; expected a mapping")
        return {}
    if not isinstance(raw, dict):
        raise SimError(f"{path}: expected a mapping, got {raw!r}")
    if allowed is not None:
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise SimError(f"{path}.{unknown[0]}: unknown key; expected some of {sorted(allowed)}")
    return raw


def number(block: dict[str, Any], key: str, path: str, *, default: Any = MISSING, gt: float | None = None,
            ge: float | None = None, lt: float | None = None, le: float | None = None) -> float:
    if key not in block or block[key] is None:
        if default is MISSING:
            raise SimError(f"{path}.{key}: missing; expected a number")
        return float(default)
    raw = block[key]
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise SimError(f"{path}.{key}: expected a number, got {raw!r}")
    value = float(raw)
    for bound, ok, word in ((gt, lambda v, b: v > b, ">"), (ge, lambda v, b: v >= b, ">="),
                            (lt, lambda v, b: v < b, "<"), (le, lambda v, b: v <= b, "<=")):
        if bound is not None and not ok(value, bound):
            raise SimError(f"{path}.{key}: {value:g} must be {word} {bound:g}")
    return value


def whole(block: dict[str, Any], key: str, path: str, *, ge: int, default: Any = MISSING) -> int:
    if key not in block or block[key] is None:
        if default is MISSING:
            raise SimError(f"{path}.{key}: missing; expected a whole number >= {ge}")
        return int(default)
    raw = block[key]
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < ge:
        raise SimError(f"{path}.{key}: {raw!r}; expected a whole number >= {ge}")
    return raw
