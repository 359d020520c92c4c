"""`--plot`: KV size against context length for several models (dense vs hybrid) and Phi against
length for the planned model, written as one PNG with matplotlib's file-only Agg backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from crossfill.planner.dtypes import KV_DTYPES, KVDtype
from crossfill.planner.errors import PlanError
from crossfill.planner.kv_accounting import ModelKV
from crossfill.planner.model_source import load_model
from crossfill.planner.profiles import PrefillProfile

COMPARISON_PRESETS = (
    "llama-3.1-70b",
    "qwen3-235b-a22b",
    "minimax-m2",
    "deepseek-v3",
    "gemma-3-27b",
    "mimo-v2-flash",
    "qwen3-next-80b-a3b",
    "kimi-linear-48b-a3b",
)


def plot_kv_and_phi(
    path: str | Path,
    model: ModelKV,
    dtype: KVDtype,
    state_dtype: KVDtype,
    prefill: PrefillProfile | None,
    link_gbps: float | None,
    instances: int,
    max_len: int = 131072,
    curve: list[dict] | None = None,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise PlanError(f"--plot: {out} must end in .png, .svg or .pdf")
    lengths = np.unique(np.geomspace(128, max_len, 60).round().astype(int))
    models = [model] + [load_model(n) for n in COMPARISON_PRESETS if load_model(n).name != model.name]
    panels = 1 + (prefill is not None) + (curve is not None)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5), squeeze=False)
    ax = axes[0][0]
    for m in models:
        kv = [m.request_bytes(int(n), dtype, state_dtype) / 1e9 for n in lengths]
        style = "--" if m.is_hybrid else "-"
        ax.plot(lengths, kv, style, lw=2.5 if m is model else 1.2, label=f"{m.name}{' (hybrid)' if m.is_hybrid else ''}")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel=f"KV per request (GB, {dtype.name})")
    ax.set_title("KV cache per request: dense (solid) vs hybrid (dashed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    if prefill:
        ax = axes[0][1]
        secs = prefill.seconds_at(lengths)
        variants = [(model, dtype, model.name)]
        variants += [(model, KV_DTYPES[d], f"{model.name} {d}") for d in ("fp8", "int4") if KV_DTYPES[d].bits < dtype.bits]
        if model.is_hybrid:
            dense = model.dense_equivalent()
            variants.append((dense, dtype, dense.name))
        for m, dt, label in variants:
            kv = np.array([m.request_bytes(int(n), dt, state_dtype) for n in lengths], dtype=float)
            ax.plot(lengths, kv * 8 / secs / 1e9, label=label)
        if link_gbps:
            ax.axhline(link_gbps / instances, color="k", ls=":", label=f"link / {instances} instance(s)")
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="Phi per prefill instance (Gbps)")
        ax.set_title(f"KV throughput Phi (prefill: {prefill.source})", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if curve:
        ax = axes[0][-1]
        thresholds = [c["threshold"] for c in curve]
        ax.plot(thresholds, [c["throughput_rps"] for c in curve], label="cluster throughput (best split)")
        best = max(curve, key=lambda c: c["throughput_rps"])
        ax.plot([best["threshold"]], [best["throughput_rps"]], "o", color="k", label="optimum")
        ax.set(xscale="log", xlabel="offload threshold t (tokens)", ylabel="requests/s")
        twin = ax.twinx()
        twin.plot(thresholds, [c["offload_share"] for c in curve], "--", color="gray", label="offloaded share")
        twin.set_ylabel("offloaded share")
        ax.set_title("Throughput against the offload threshold")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        twin.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise PlanError(f"--plot: cannot write {out} ({exc})") from exc
    finally:
        plt.close(fig)
    return out
