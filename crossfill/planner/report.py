"""Turn planner results into one JSON-able dictionary, and that dictionary into readable text.

`--json` prints the dictionary; the text report is rendered from the same dictionary, so the two
never disagree. Sizes are decimal (1 MB = 10^6 bytes) to match link speeds in Gbps.
"""

from __future__ import annotations

import math
from typing import Any

from crossfill.planner.bandwidth import LinkCase
from crossfill.planner.dtypes import KVDtype
from crossfill.planner.kv_accounting import ModelKV
from crossfill.planner.optimizer import ClusterSetup, Evaluation


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: float | None, fmt: str = ".3g") -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return format(x, fmt)


def kv_summary(model: ModelKV, dtype: KVDtype, state_dtype: KVDtype, lengths: list[float]) -> dict[str, Any]:
    state = sum(layer.state_bytes(state_dtype) for layer in model.layers)
    return {
        "model": model.name,
        "source": model.source,
        "layers": model.kind_counts(),
        "sliding_keep": model.sliding_keep,
        "dtype": dtype.name,
        "state_dtype": state_dtype.name,
        "bytes_per_token_all_layers": model.first_token_bytes(dtype),
        "bytes_per_token_growing": model.growing_bytes_per_token(dtype),
        "state_bytes_per_request": state,
        "per_request": [
            {
                "context_len": int(round(n)),
                "bytes": model.request_bytes(int(round(n)), dtype, state_dtype),
                "by_kind": model.breakdown(int(round(n)), dtype, state_dtype),
            }
            for n in lengths
        ],
    }


def link_entry(case: LinkCase, alternatives: list[LinkCase], link_gbps: float | None) -> dict[str, Any]:
    entry = case.as_dict()
    entry["alternatives"] = [alt.as_dict() for alt in alternatives]
    if link_gbps is not None:
        entry["verdict"] = verdict(case, alternatives, link_gbps)
    return entry


def verdict(case: LinkCase, alternatives: list[LinkCase], link_gbps: float) -> str:
    """One sentence: does the link carry the pool's KV, and what would change the answer."""
    if case.fits:
        text = f"fits: the pool needs {case.pool_egress_gbps:.3g} of {link_gbps:g} Gbps"
        flips = [a.label for a in alternatives if a.fits is False]
        if flips:
            text += f"; it would not fit as {', '.join(flips)} ({max(a.pool_egress_gbps for a in alternatives):.3g} Gbps)"
        return text
    share = case.link_share_of_pool or 0.0
    text = (
        f"does not fit: the pool needs {case.pool_egress_gbps:.3g} Gbps; {link_gbps:g} Gbps carries "
        f"{_num(case.link_max_rps)} req/s = {share:.0%} of its prefill output"
    )
    fixes = [a.label for a in alternatives if a.fits]
    text += f"; fits with {', '.join(fixes)}" if fixes else "; no KV dtype here makes it fit: offload fewer requests"
    return text


def optimum_summary(
    setup: ClusterSetup, best: Evaluation, baseline: Evaluation, curve: list[Evaluation]
) -> dict[str, Any]:
    """The optimum, the local-only baseline, and the best split at every threshold tried."""
    gain = best.throughput_rps / baseline.throughput_rps if baseline.throughput_rps > 0 else math.inf
    # How forgiving the threshold is: the range of thresholds within 5% of the optimum.
    near = [e.threshold for e in curve if e.throughput_rps >= 0.95 * best.throughput_rps]
    return {
        "workload": setup.workload.describe(),
        "link_gbps": setup.link_gbps,
        "remote_instances": setup.remote_instances,
        "local_instances": setup.local_instances,
        "decode_requests_per_s_per_instance": setup.decode_rps_per_instance(),
        "decode_batch_at_slo": setup.decode_batch(),
        "decode_kv_bytes_per_request": setup.decode_kv_bytes,
        "best": best.as_dict(),
        "local_only": baseline.as_dict(),
        "gain_over_local_only": None if math.isinf(gain) else gain,
        "near_optimal_thresholds": [min(near), max(near)] if near else None,
        "curve": [
            {
                "threshold": e.threshold,
                "offload_share": e.offload_share,
                "throughput_rps": e.throughput_rps,
                "bottleneck": e.bottleneck,
                "local_prefill_instances": e.local_prefill_instances,
                "link_egress_gbps": e.link_egress_gbps,
            }
            for e in curve
        ],
    }


def render_text(result: dict[str, Any]) -> str:
    lines: list[str] = []
    kv = result["kv"]
    layers = ", ".join(f"{v} {k}" for k, v in kv["layers"].items())
    lines.append(f"Model {kv['model']}: {layers} layers; KV dtype {kv['dtype']}, state dtype {kv['state_dtype']}")
    if kv["source"]:
        lines.append(f"  source: {kv['source']}")
    if "sliding" in kv["layers"]:
        keep = "window - 1 (crossfill engine)" if kv["sliding_keep"] == "window-1" else "window"
        lines.append(f"  sliding layers keep {keep} tokens")
    lines.append(
        f"  KV per token: {human_bytes(kv['bytes_per_token_all_layers'])} while windows fill, "
        f"{human_bytes(kv['bytes_per_token_growing'])} beyond (full/MLA layers)"
        + (f"; fixed state {human_bytes(kv['state_bytes_per_request'])} per request" if kv["state_bytes_per_request"] else "")
    )
    for row in kv["per_request"]:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in row["by_kind"].items())
        lines.append(f"  {row['context_len']:>8} tokens: {human_bytes(row['bytes']):>10} per request ({parts})")
    if result.get("workload"):
        w = result["workload"]
        lines.append("Workload: " + ", ".join(f"{k}={v}" for k, v in w.items()))
    link = result.get("link")
    if link:
        lines.append(
            f"Link: prefill {link['prefill']}, {link['instances']} instance(s), "
            + (f"link {link['link_gbps']:g} Gbps" if link["link_gbps"] is not None else "no link given (--link-gbps)")
        )
        for e in link["cases"]:
            lines.append(
                f"  {e['label']} @ {e['context_len']:.0f} tokens: prefill {e['prefill_seconds']:.3g} s, "
                f"KV {human_bytes(e['kv_bytes'])}, Phi {e['phi_gbps']:.3g} Gbps/instance, "
                f"pool egress {e['pool_egress_gbps']:.3g} Gbps"
                + (f", link carries {_num(e['link_max_rps'])} req/s" if e["link_max_rps"] is not None else "")
            )
            for a in e["alternatives"]:
                lines.append(
                    f"      vs {a['label']}: KV {human_bytes(a['kv_bytes'])}, Phi {a['phi_gbps']:.3g} Gbps, "
                    f"pool egress {a['pool_egress_gbps']:.3g} Gbps"
                    + ("" if a["fits"] is None else (" (fits)" if a["fits"] else " (does not fit)"))
                )
            if "verdict" in e:
                lines.append(f"    verdict: {e['verdict']}")
        for warning in link.get("warnings", []):
            lines.append(f"  warning: {warning}")
    opt = result.get("optimize")
    if opt:
        b, base = opt["best"], opt["local_only"]
        lines.append(
            f"Optimum: offload prompts longer than {b['threshold']:.0f} tokens "
            f"({b['offload_share']:.1%} of requests, mean {b['offload_mean_len']:.0f} tokens; "
            f"local mean {b['local_mean_len']:.0f})"
        )
        lines.append(
            f"  pools: {b['remote_instances']} remote prefill, {b['local_prefill_instances']} local prefill, "
            f"{b['decode_instances']} decode (decode batch {opt['decode_batch_at_slo']} within SLO and KV memory, "
            f"{opt['decode_requests_per_s_per_instance']:.3g} req/s per instance)"
        )
        lines.append(
            f"  stage capacity (req/s of the requests each serves): remote compute {_num(b['remote_compute_rps'])}, "
            f"link {_num(b['remote_link_rps'])}, local prefill {_num(b['local_prefill_rps'])}, "
            f"decode {_num(b['decode_rps'])}"
        )
        lines.append(
            f"  cluster throughput {b['throughput_rps']:.4g} req/s, bottleneck: {b['bottleneck']}; "
            f"link egress {b['link_egress_gbps']:.3g} Gbps ({b['link_utilisation']:.0%} of {opt['link_gbps']:g})"
        )
        near = opt.get("near_optimal_thresholds")
        if near:
            lines.append(f"  thresholds from {near[0]:.0f} to {near[1]:.0f} tokens stay within 5% of the optimum")
        gain = opt["gain_over_local_only"]
        lines.append(
            f"  local only: {base['throughput_rps']:.4g} req/s ({base['local_prefill_instances']} prefill + "
            f"{base['decode_instances']} decode, bottleneck {base['bottleneck']})"
            + (f"; offloading gains x{gain:.3g}" if gain is not None else "")
        )
    if result.get("calibration"):
        c = result["calibration"]
        lines.append(f"Calibration ({c['source']}):")
        for n, s, kvb, model_kv in zip(c["lengths"], c["seconds"], c["kv_bytes"], c["model_kv_bytes"], strict=True):
            lines.append(
                f"  {n:>8.0f} tokens: prefill {s:.3g} s ({n / s:.0f} tok/s), KV sent {human_bytes(kvb)}, "
                f"accounting says {human_bytes(model_kv)}"
            )
    if result.get("plot"):
        lines.append(f"Plot written to {result['plot']}")
    return "\n".join(lines)
