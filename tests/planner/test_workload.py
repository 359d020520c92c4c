"""Offloaded share and conditional mean length of truncated log-normal and empirical workloads."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from crossfill.planner.errors import PlanError
from crossfill.planner.workload import EmpiricalWorkload, LogNormalWorkload, parse_workload_spec


def _numeric(mu: float, sigma: float, lo: float, hi: float, t: float) -> tuple[float, float]:
    """Share above t and E[L | L > t] by brute-force integration of the density over u = ln L."""

    def density(u: np.ndarray) -> np.ndarray:
        return np.exp(-0.5 * ((u - mu) / sigma) ** 2)  # normal in u = ln L; the constant cancels

    u_all = np.linspace(math.log(lo), math.log(hi), 400_001)
    u_tail = np.linspace(math.log(t), math.log(hi), 400_001)
    tail = np.trapezoid(density(u_tail), u_tail)
    return tail / np.trapezoid(density(u_all), u_all), np.trapezoid(np.exp(u_tail) * density(u_tail), u_tail) / tail


@pytest.mark.parametrize("t", [300.0, 4000.0, 8192.0, 30000.0, 100000.0])
def test_truncated_lognormal_share_and_conditional_mean(t: float) -> None:
    w = LogNormalWorkload.from_median(8192, 1.1, lo=128, hi=131072)
    share, mean = _numeric(math.log(8192), 1.1, 128, 131072, t)
    assert w.share_above(t) == pytest.approx(share, rel=1e-5)
    assert w.mean_above(t) == pytest.approx(mean, rel=1e-5)
    # The generic integrator agrees with the closed forms.
    assert w.expect(lambda x: x, above=t) / w.share_above(t) == pytest.approx(mean, rel=1e-5)
    assert w.expect(np.ones_like, at_most=t) == pytest.approx(1 - share, rel=1e-5)


def test_untruncated_lognormal_known_values() -> None:
    w = LogNormalWorkload.from_median(1000, 0.5)
    assert w.share_above(1000) == pytest.approx(0.5, abs=1e-12)
    assert w.mean() == pytest.approx(1000 * math.exp(0.125), rel=1e-12)
    assert w.quantile(0.5) == pytest.approx(1000, rel=1e-9)
    # E[L | L > median] = e^(mu + s^2/2) * Phi(s) / 0.5 for an untruncated log-normal.
    phi_s = 0.5 * (1 + math.erf(0.5 / math.sqrt(2)))
    assert w.mean_above(1000) == pytest.approx(1000 * math.exp(0.125) * phi_s / 0.5, rel=1e-12)


def test_empirical_shares_are_exact(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("prompt_tokens,other\n100,x\n200,x\n300,x\n5000,x\n")
    w = parse_workload_spec(f"empirical:{path}")
    assert w.share_above(200) == 0.5
    assert w.mean_above(200) == 2650
    assert w.mean_at_most(200) == 150
    assert w.expect(lambda x: x * 2, above=250) == (600 + 10000) / 4


def test_spec_parsing_and_errors() -> None:
    w = parse_workload_spec("lognormal:median=2000,sigma=0.8,min=16,max=32768")
    assert isinstance(w, LogNormalWorkload) and w.lo == 16 and w.hi == 32768
    with pytest.raises(PlanError, match="workload.sigma"):
        parse_workload_spec("lognormal:median=2000,sigma=0")
    with pytest.raises(PlanError, match="lognormal.median: missing"):
        parse_workload_spec("lognormal:sigma=1")
    with pytest.raises(PlanError, match="unknown distribution 'pareto'"):
        parse_workload_spec("pareto:alpha=2")
    with pytest.raises(PlanError, match="does not exist"):
        parse_workload_spec("empirical:/nonexistent/lengths.txt")
    with pytest.raises(PlanError, match="> 0 tokens"):
        EmpiricalWorkload(np.array([10.0, -1.0]))
