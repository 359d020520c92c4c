"""Least-squares trends of the soak's resource samples, per process, against leak bounds.

What is judged is growth while nothing happens. Two things move memory legitimately and are kept
out of the slope:
- warm-up: a process's RSS settles in steps at first (model load, allocator arenas, batch shapes
  seen for the first time). A process restarted by `up` (a fault killed it) is a new series — its
  pid changes — judged after its own warm-up.
- faults: a fault reshapes the load (a dead remote sends a burst of fallbacks to the local
  prefill, whose allocator then keeps the larger arenas), so memory may step to a new level. The
  samples from a fault's start until `settle_s` after it healed are left out, and each quiet phase
  between faults gets its own intercept: the slope is the common within-phase least-squares slope.
A leak grows inside the quiet phases too, so it still shows; a level step at a fault does not.

Verdicts are judged with the slope's uncertainty (two standard errors, ~95 %): "fail" when even
the low end is above the bound, "pass" when even the high end is below it, "inconclusive" when
the run was too short or too noisy to tell (run it longer), "n/a" when too little quiet data.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from crossfill.reliability.sampler import ProcSample

# Per hour, after the warm-up: a leak of one fd or one thread per request or per fault exceeds these.
BOUNDS: dict[str, float] = {"rss_mb": 50.0, "fds": 60.0, "threads": 12.0}
_VALUE = {"rss_mb": lambda s: s.rss / 2**20, "fds": lambda s: float(s.fds), "threads": lambda s: float(s.threads)}


@dataclass(frozen=True)
class Trend:
    process: str
    pid: int
    metric: str
    slope_per_h: float | None  # None: too little quiet data after the warm-up
    bound: float
    span_s: float  # quiet time the slope was fitted over
    samples: int
    stderr_per_h: float = math.inf

    @property
    def verdict(self) -> Literal["pass", "fail", "inconclusive", "n/a"]:
        if self.slope_per_h is None:
            return "n/a"
        if self.slope_per_h - 2 * self.stderr_per_h > self.bound:
            return "fail"
        if self.slope_per_h + 2 * self.stderr_per_h < self.bound:
            return "pass"
        return "inconclusive"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def phase_slope(phases: Sequence[Sequence[tuple[float, float]]]) -> tuple[float, float]:
    """Least-squares slope of y over t with one intercept per phase (each a list of (t, y)), and
    its standard error (inf when there are too few points to estimate the noise)."""
    used = [pts for pts in phases if len(pts) >= 2]
    centred = []
    for pts in used:
        mt = sum(t for t, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        centred += [(t - mt, y - my) for t, y in pts]
    den = sum(t * t for t, _ in centred)
    if not den:
        return 0.0, math.inf
    slope = sum(t * y for t, y in centred) / den
    dof = len(centred) - len(used) - 1
    if dof <= 0:
        return slope, math.inf
    residual = sum((y - slope * t) ** 2 for t, y in centred) / dof
    return slope, math.sqrt(residual / den)


def trends(samples: list[ProcSample], warmup_s: float, min_span_s: float,
           disturbed: Sequence[tuple[float, float]] = (), bounds: dict[str, float] | None = None) -> list[Trend]:
    """One Trend per (process, pid, metric). `disturbed`: (start, end) windows left out, each
    ending a quiet phase (see the module docstring)."""
    bounds = bounds or BOUNDS
    windows = sorted(disturbed)
    segments: dict[tuple[str, int], list[ProcSample]] = defaultdict(list)
    for s in samples:
        segments[(s.name, s.pid)].append(s)
    out = []
    for (name, pid), seg in sorted(segments.items(), key=lambda kv: (kv[0][0], kv[1][0].t)):
        start = seg[0].t
        phases: dict[int, list[ProcSample]] = defaultdict(list)
        for s in seg:
            if s.t - start < warmup_s or any(a <= s.t <= b for a, b in windows):
                continue
            phases[sum(b < s.t for _, b in windows)].append(s)
        span = sum(p[-1].t - p[0].t for p in phases.values())
        kept = sum(len(p) for p in phases.values())
        for metric, bound in bounds.items():
            if kept < 3 or span < min_span_s:
                out.append(Trend(name, pid, metric, None, bound, span, kept))
                continue
            slope, stderr = phase_slope([[(s.t, _VALUE[metric](s)) for s in p] for p in phases.values()])
            out.append(Trend(name, pid, metric, slope * 3600, bound, span, kept, stderr * 3600))
    return out
