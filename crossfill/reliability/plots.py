"""PNG plots of the soak's samples: one figure per resource, one line per process, faults marked."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from crossfill.reliability.sampler import KVSample, ProcSample


def _figure(path: Path, title: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]],
            faults: list[tuple[float, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for label, (ts, ys) in sorted(series.items()):
        ax.plot([t / 60 for t in ts], ys, label=label, linewidth=1.2)
    for t, name in faults:
        ax.axvline(t / 60, color="grey", linestyle=":", linewidth=1)
        ax.annotate(name, (t / 60, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    va="top", ha="right", color="grey")
    ax.set_xlabel("minutes")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_soak(out: Path, procs: list[ProcSample], kv: list[KVSample], faults: list[tuple[float, str]]) -> list[Path]:
    """Write rss.png, fds.png, threads.png and kv_blocks.png into `out`; return their paths."""
    def by_process(value) -> dict[str, tuple[list[float], list[float]]]:
        series: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        for s in procs:
            series[s.name][0].append(s.t)
            series[s.name][1].append(value(s))
        return series

    kv_series: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for k in kv:
        kv_series[k.name][0].append(k.t)
        kv_series[k.name][1].append(float(k.blocks_used))
    plots = [
        ("rss.png", "resident memory per process", "RSS (MiB)", by_process(lambda s: s.rss / 2**20)),
        ("fds.png", "open file descriptors per process", "fds", by_process(lambda s: s.fds)),
        ("threads.png", "threads per process", "threads", by_process(lambda s: s.threads)),
        ("kv_blocks.png", "KV blocks in use per worker", "blocks used", kv_series),
    ]
    paths = []
    for name, title, ylabel, series in plots:
        _figure(out / name, title, ylabel, series, faults)
        paths.append(out / name)
    return paths
