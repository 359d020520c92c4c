"""Prompt-length distributions: which share of requests a threshold offloads, and how long they are.

Two kinds, behind one interface:

* `LogNormalWorkload`: ln(L) ~ N(mu, sigma^2) truncated to [lo, hi], the usual shape of production
  prompt lengths. Shares and conditional means are exact closed forms (normal CDF via `math.erf`);
  expectations of other functions (prefill time, KV bytes) integrate over a fine log-spaced grid
  whose bin masses are exact CDF differences, each bin represented by its exact conditional mean.
* `EmpiricalWorkload`: a list of observed lengths (a trace), every expectation an exact sample mean.

A request "is offloaded at threshold t" when its length is strictly greater than t.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from crossfill.planner.errors import PlanError

LengthFn = Callable[[np.ndarray], np.ndarray]


class Workload(Protocol):
    lo: float
    hi: float

    def share_above(self, t: float) -> float: ...
    def mean_above(self, t: float) -> float: ...
    def mean_at_most(self, t: float) -> float: ...
    def expect(self, f: LengthFn, above: float | None = None, at_most: float | None = None) -> float: ...
    def quantile(self, q: float) -> float: ...
    def mean(self) -> float: ...
    def describe(self) -> dict[str, object]: ...


def _phi(z: float) -> float:
    """Standard normal CDF."""
    if z == math.inf:
        return 1.0
    if z == -math.inf:
        return 0.0
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@dataclass(frozen=True)
class LogNormalWorkload:
    """Prompt lengths with ln(L) ~ N(mu, sigma^2), truncated to [lo, hi]."""

    mu: float
    sigma: float
    lo: float = 1.0
    hi: float = math.inf
    grid_points: int = 4000
    _norm: float = field(init=False, repr=False, default=1.0)

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise PlanError(f"workload.sigma: {self.sigma} must be > 0 (spread of ln length)")
        if not 0 < self.lo < self.hi:
            raise PlanError(f"workload.min/max: need 0 < min < max, got min={self.lo}, max={self.hi}")
        norm = _phi(self._z(self.hi)) - _phi(self._z(self.lo))
        if norm <= 1e-12:
            raise PlanError("workload: [min, max] holds no probability mass for this median and sigma")
        object.__setattr__(self, "_norm", norm)

    @classmethod
    def from_median(cls, median: float, sigma: float, lo: float = 1.0, hi: float = math.inf) -> LogNormalWorkload:
        if not median > 0:
            raise PlanError(f"workload.median: {median} must be > 0 tokens")
        return cls(math.log(median), sigma, lo, hi)

    def _z(self, x: float) -> float:
        if x <= 0:
            return -math.inf
        return math.inf if x == math.inf else (math.log(x) - self.mu) / self.sigma

    def cdf(self, x: float) -> float:
        x = min(max(x, self.lo), self.hi)
        return (_phi(self._z(x)) - _phi(self._z(self.lo))) / self._norm

    def _partial_mean(self, a: float, b: float) -> float:
        """E[L ; a < L <= b] (unnormalised by the mass of (a, b])."""
        a, b = max(a, self.lo), min(b, self.hi)
        if b <= a:
            return 0.0
        s = self.sigma
        scale = math.exp(self.mu + s * s / 2)
        return scale * (_phi(self._z(b) - s) - _phi(self._z(a) - s)) / self._norm

    def share_above(self, t: float) -> float:
        return 1.0 - self.cdf(t)

    def mean_above(self, t: float) -> float:
        p = self.share_above(t)
        return self._partial_mean(t, math.inf) / p if p > 0 else 0.0

    def mean_at_most(self, t: float) -> float:
        q = self.cdf(t)
        return self._partial_mean(-math.inf, t) / q if q > 0 else 0.0

    def mean(self) -> float:
        return self._partial_mean(-math.inf, math.inf)

    def quantile(self, q: float) -> float:
        if not 0 <= q <= 1:
            raise PlanError(f"quantile {q} must lie in [0, 1]")
        lo_mass = _phi(self._z(self.lo))
        target = lo_mass + q * self._norm
        # Bisection on the z-scale keeps this free of scipy's inverse normal CDF.
        a, b = -40.0, 40.0
        for _ in range(200):
            m = (a + b) / 2
            a, b = (m, b) if _phi(m) < target else (a, m)
        return float(min(max(math.exp(self.mu + self.sigma * (a + b) / 2), self.lo), self.hi))

    @cached_property
    def _grid(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Edges, exact masses and exact conditional means of a log-spaced grid over the support.

        Computed once per workload; an unbounded upper tail is cut at the 1 - 1e-9 quantile.
        """
        top = self.hi if self.hi < math.inf else self.quantile(1 - 1e-9)
        edges = np.geomspace(self.lo, top, self.grid_points + 1)
        cdf = np.array([self.cdf(float(x)) for x in edges])
        s = self.sigma
        shifted = np.array([_phi(self._z(float(x)) - s) for x in edges])
        masses = np.diff(cdf)
        partial = math.exp(self.mu + s * s / 2) * np.diff(shifted) / self._norm
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(masses > 0, partial / masses, edges[:-1])
        return edges, masses, means

    def expect(self, f: LengthFn, above: float | None = None, at_most: float | None = None) -> float:
        """E[f(L) ; above < L <= at_most] (not divided by the mass of that range)."""
        edges, masses, means = self._grid
        a = self.lo if above is None else max(above, self.lo)
        b = edges[-1] if at_most is None else min(at_most, edges[-1])
        if b <= a:
            return 0.0
        inside = (edges[:-1] >= a) & (edges[1:] <= b)
        points, weights = list(means[inside]), list(masses[inside])
        # The bins cut by a or b contribute their clipped part, computed exactly.
        for i in {int(np.searchsorted(edges, a, side="right")) - 1, int(np.searchsorted(edges, b, side="left")) - 1}:
            if 0 <= i < len(masses) and not inside[i]:
                x, y = max(edges[i], a), min(edges[i + 1], b)
                m = self.cdf(y) - self.cdf(x) if y > x else 0.0
                if m > 0:
                    points.append(self._partial_mean(x, y) / m)
                    weights.append(m)
        if not points:
            return 0.0
        values = np.asarray(f(np.asarray(points, dtype=float)), dtype=float)
        return float(np.sum(values * np.asarray(weights)))

    def describe(self) -> dict[str, object]:
        return {
            "kind": "lognormal",
            "median": round(math.exp(self.mu), 3),
            "sigma": self.sigma,
            "min": self.lo,
            "max": self.hi,
            "mean": round(self.mean(), 3),
        }


@dataclass(frozen=True)
class EmpiricalWorkload:
    """Observed prompt lengths, each equally likely."""

    lengths: np.ndarray
    source: str = ""
    _sums: dict[LengthFn, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        arr = np.sort(np.asarray(self.lengths, dtype=float))
        if arr.size == 0:
            raise PlanError(f"workload {self.source or ''}: no lengths; expected at least one positive length".strip())
        if not np.all(np.isfinite(arr)) or arr[0] <= 0:
            raise PlanError(f"workload {self.source}: lengths must be finite and > 0 tokens".replace("  ", " "))
        object.__setattr__(self, "lengths", arr)

    @property
    def lo(self) -> float:
        return float(self.lengths[0])

    @property
    def hi(self) -> float:
        return float(self.lengths[-1])

    # `lengths` is sorted, so every range (above, at_most] is one slice found by binary search.
    def _slice(self, above: float | None, at_most: float | None) -> np.ndarray:
        start = 0 if above is None else int(np.searchsorted(self.lengths, above, side="right"))
        stop = self.lengths.size if at_most is None else int(np.searchsorted(self.lengths, at_most, side="right"))
        return self.lengths[start:max(start, stop)]

    def share_above(self, t: float) -> float:
        return self._slice(t, None).size / self.lengths.size

    def mean_above(self, t: float) -> float:
        sel = self._slice(t, None)
        return float(sel.mean()) if sel.size else 0.0

    def mean_at_most(self, t: float) -> float:
        sel = self._slice(None, t)
        return float(sel.mean()) if sel.size else 0.0

    def mean(self) -> float:
        return float(self.lengths.mean())

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.lengths, q))

    def _prefix_sums(self, f: LengthFn) -> np.ndarray:
        """Running sums of f over the sorted lengths, kept per function: the optimiser asks for the
        same few functions (prefill time, KV bytes) over hundreds of thresholds."""
        sums = self._sums
        if f not in sums:
            if len(sums) >= 16:
                sums.clear()
            sums[f] = np.concatenate([[0.0], np.cumsum(np.asarray(f(self.lengths), dtype=float))])
        return sums[f]

    def expect(self, f: LengthFn, above: float | None = None, at_most: float | None = None) -> float:
        start = 0 if above is None else int(np.searchsorted(self.lengths, above, side="right"))
        stop = self.lengths.size if at_most is None else int(np.searchsorted(self.lengths, at_most, side="right"))
        if stop <= start:
            return 0.0
        sums = self._prefix_sums(f)
        return float((sums[stop] - sums[start]) / self.lengths.size)

    def describe(self) -> dict[str, object]:
        return {
            "kind": "empirical",
            "source": self.source,
            "requests": int(self.lengths.size),
            "min": self.lo,
            "max": self.hi,
            "mean": round(self.mean(), 3),
        }


def load_lengths_file(path: str | Path) -> np.ndarray:
    """Lengths from a text/CSV file (one number per line, or the first column) or a JSON list."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"workload.empirical: file {p} does not exist; expected prompt lengths, one per line")
    text = p.read_text()
    values: list[float] = []
    try:
        if p.suffix == ".json":
            import json

            data = json.loads(text)
            values = [float(x) for x in (data["lengths"] if isinstance(data, dict) else data)]
        else:
            for i, line in enumerate(text.splitlines()):
                cell = line.split(",")[0].strip()
                if not cell or cell.startswith("#"):
                    continue
                try:
                    values.append(float(cell))
                except ValueError:
                    if i == 0:  # a CSV header
                        continue
                    raise
    except (ValueError, KeyError, TypeError) as exc:
        raise PlanError(f"workload.empirical: {p} is not a list of numbers ({exc})") from exc
    return np.asarray(values)


def parse_workload_spec(spec: str) -> Workload:
    """``lognormal:median=8192,sigma=1.0,min=128,max=131072`` or ``empirical:PATH``."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "empirical":
        return EmpiricalWorkload(load_lengths_file(rest), source=rest)
    if kind == "lognormal":
        params: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise PlanError(f"--lengths: {item!r} is not key=value")
            try:
                params[key.strip()] = float(value)
            except ValueError as exc:
                raise PlanError(f"--lengths: {key}={value!r} is not a number") from exc
        return workload_from_mapping({"lognormal": params}, "--lengths")
    raise PlanError(f"--lengths: unknown distribution {kind!r}; expected 'lognormal:median=..,sigma=..' or 'empirical:PATH'")


def workload_from_mapping(data: object, field_name: str = "workload") -> Workload:
    """The ``workload:`` block of a profile YAML (or the parsed `--lengths`)."""
    if not isinstance(data, dict) or len(data) != 1:
        raise PlanError(f"{field_name}: expected one of 'lognormal: {{median, sigma, min, max}}' or 'empirical: PATH'")
    ((kind, body),) = data.items()
    if kind == "empirical":
        if isinstance(body, list):
            return EmpiricalWorkload(np.asarray(body, dtype=float), source=f"{field_name}.empirical")
        return EmpiricalWorkload(load_lengths_file(str(body)), source=str(body))
    if kind == "lognormal" and isinstance(body, dict):
        unknown = set(body) - {"median", "sigma", "min", "max"}
        if unknown:
            raise PlanError(f"{field_name}.lognormal: unknown keys {sorted(unknown)}; expected median, sigma, min, max")
        for key in ("median", "sigma"):
            if key not in body:
                raise PlanError(f"{field_name}.lognormal.{key}: missing; expected a positive number")
        return LogNormalWorkload.from_median(
            float(body["median"]), float(body["sigma"]), float(body.get("min", 1.0)), float(body.get("max", math.inf))
        )
    raise PlanError(f"{field_name}: unknown kind {kind!r}; expected 'lognormal' or 'empirical'")
