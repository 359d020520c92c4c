"""The PNG of a run: TTFT CDF per strategy, goodput bars (planner capacity beside them), and link
utilisation over time, with matplotlib's file-only Agg backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from crossfill.sim.cluster import RunResult
from crossfill.sim.errors import SimError
from crossfill.sim.metrics import link_utilisation


def plot_runs(path: str | Path, results: list[RunResult], summaries: list[dict[str, Any]], ttft_slo_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    # One colour per strategy in every panel (homogeneous-pd has no link series to shift the cycle).
    colour = {res.strategy.name: f"C{i}" for i, res in enumerate(results)}
    fig, (ax_cdf, ax_bar, ax_link) = plt.subplots(1, 3, figsize=(19, 5))
    for res in results:
        ttft = np.sort(np.asarray(res.ttft, dtype=float))
        ttft = ttft[~np.isnan(ttft)]
        if ttft.size:
            # Refused and unfinished requests never reach 1: the curve tops out at the completed share.
            ax_cdf.plot(ttft, np.arange(1, ttft.size + 1) / len(res.ttft), label=res.strategy.name,
                        color=colour[res.strategy.name])
    ax_cdf.axvline(ttft_slo_s, color="k", ls=":", label=f"TTFT SLO {ttft_slo_s:g} s")
    ax_cdf.set(xscale="log", xlabel="TTFT (s)", ylabel="share of requests", title="TTFT CDF")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=8)

    names = [s["strategy"] for s in summaries]
    x = np.arange(len(names))
    ax_bar.bar(x - 0.2, [s["goodput_rps"] for s in summaries], 0.4, label="simulated goodput")
    ax_bar.bar(x + 0.2, [s["analytic_rps"] or 0 for s in summaries], 0.4, label="planner capacity", alpha=0.6)
    ax_bar.set_xticks(x, names, rotation=15, fontsize=8)
    ax_bar.set(ylabel="requests/s", title="Goodput (both SLOs met)")
    ax_bar.legend(fontsize=8)

    for res in results:
        util = link_utilisation(res)
        if util.size:
            window = max(1, util.size // 300)  # smooth to ~300 points
            smooth = np.convolve(util, np.ones(window) / window, mode="valid")
            ax_link.plot(np.arange(smooth.size) + res.requests.arrival[0], smooth * 100, label=res.strategy.name,
                         color=colour[res.strategy.name], lw=0.8)
    ax_link.set(xlabel="simulated time (s)", ylabel="% of nominal bandwidth", title="Inter-DC link utilisation")
    ax_link.grid(True, alpha=0.3)
    ax_link.legend(fontsize=8)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise SimError(f"--out: cannot write {out} ({exc})") from None
    finally:
        plt.close(fig)
    return out
