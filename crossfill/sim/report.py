"""The terminal report: rich tables rendered from the same dictionary `--json` prints."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _f(x: float | None, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def render(report: dict[str, Any], console: Console) -> None:
    s = report["setup"]
    console.print(f"[bold]crossfill simulate[/bold] {s['source']}: {s['requests']} requests "
                  f"({s['requests_source']}, {_f(s['offered_rps'])} req/s offered, seed {s['seed']}); "
                  f"model {s['model']}; link {s['link']['gbps']:g} Gbps, RTT {s['link']['rtt_ms']:g} ms; "
                  f"pools {s['pools']['remote']} remote ({s['pools']['remote_hardware']}) + "
                  f"{s['pools']['local']} local ({s['pools']['local_hardware']}); SLO TTFT {s['slo']['ttft_s']:g} s"
                  f"{' + ' + format(s['slo']['ttft_s_per_1k_tokens'], 'g') + ' s/1k tokens' if s['slo']['ttft_s_per_1k_tokens'] else ''}"
                  f", TPOT {s['slo']['tpot_ms']:g} ms")
    if "strategies" in report:
        console.print(_runs_table(report["strategies"]))
        for row in report["strategies"]:
            for note in row["notes"]:
                console.print(f"  {row['strategy']}: {note}")
    if "search" in report:
        console.print(_search_table(report["search"]))
    for line in report.get("skipped", []):
        console.print(f"  skipped {line}")
    for name, value in report.get("ratios", {}).items():
        console.print(f"  {name}: {_f(value, '.3f')}x")


def _runs_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="Strategies on the same arrivals")
    for col in ("strategy", "layout R/P/D", "goodput req/s", "in SLO", "planner req/s", "TTFT p50/p90/p99 s",
                "TPOT p50/p99 ms", "busy R/P/D", "link mean/p99", "offload", "prefix hit", "deferred", "errors",
                "wall s"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        lay, ttft, tpot, link = r["layout"], r["ttft_s"], r["tpot_ms"], r["link_utilisation"]
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        t.add_row(r["strategy"], f"{lay['remote_prefill']}/{lay['local_prefill']}/{lay['decode']}",
                  _f(r["goodput_rps"]), f"{r['slo_attainment']:.1%}", _f(r["analytic_rps"]),
                  f"{_f(ttft['p50'])}/{_f(ttft['p90'])}/{_f(ttft['p99'])}", f"{_f(tpot['p50'])}/{_f(tpot['p99'])}",
                  "/".join(_pct(r["busy"][k]) for k in ("remote_prefill", "local_prefill", "decode_slots")),
                  f"{link['mean']:.1%}/{link['p99']:.1%}", f"{r['offload_share']:.1%}", f"{r['prefix_hit_rate']:.1%}",
                  str(r["deferred"]), errors, f"{r['wall_s']:.1f}")
    return t


def _search_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="Highest arrival rate meeting the SLO attainment target")
    for col in ("strategy", "layout R/P/D", "max req/s", "planner req/s", "probes", "wall s"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        lay = r["layout"]
        t.add_row(r["strategy"], f"{lay['remote_prefill']}/{lay['local_prefill']}/{lay['decode']}",
                  _f(r["max_rate_rps"]), _f(r["analytic_rps"]), str(len(r["probes"])), f"{r['wall_s']:.1f}")
    return t
