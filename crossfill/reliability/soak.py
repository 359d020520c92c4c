"""`crossfill soak`: steady mixed load for N minutes with a fault every few minutes, watching for leaks.

The load mixes short local and long remote prompts, streamed and not, and multi-turn chats. Every
`fault_every_s` one fault hits, in turn: a stall of the WAN, a cut, kill -9 of the remote prefill,
a rate drop (the chaos scenarios' own code). Every `sample_s` each process of the cluster is
sampled (RSS, open fds, threads) and each worker's KV blocks. At the end: the requests' counts (the
chaos columns), KV blocks still held, least-squares slopes per hour of each process's resources in
the quiet phases between faults after a warm-up, judged against leak bounds with their
uncertainty (`trend.py`), summary.json and PNG plots in the output folder. Minutes are few for a
slope: a 10-minute run tells a gross leak; bounds like 50 MB/h need an hour or more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from crossfill.config import ConfigError, CrossfillConfig, load_config
from crossfill.reliability.cluster import ClusterView
from crossfill.reliability.load import LoadGenerator, until
from crossfill.reliability.mixes import Workloads, build_workloads
from crossfill.reliability.plots import plot_soak
from crossfill.reliability.procs import ClusterDidNotStart, UpProcess
from crossfill.reliability.sampler import Sampler
from crossfill.reliability.scenarios import FULL, SCENARIOS, Ctx, Params, Scenario
from crossfill.reliability.trend import Trend, trends
from crossfill.reliability.verdict import Row, render_text, tally

_FAULTS = ("link-stall", "link-cut", "kill-remote-prefill", "link-rate-drop")  # chaos scenarios, in turn


@dataclass
class SoakReport:
    row: Row
    trends: list[Trend]

    @property
    def trends_insufficient(self) -> bool:
        return all(t.verdict in ("n/a", "inconclusive") for t in self.trends)

    @property
    def ok(self) -> bool:
        return self.row.ok and not any(t.verdict == "fail" for t in self.trends)


_SETTLE_S = 60.0  # after a fault healed, the load takes this long to find its usual shape again


def warmup_and_span(duration_s: float) -> tuple[float, float]:
    """(warm-up, shortest quiet span judged) in seconds: a fifth of the run, at least 2 minutes (a
    torch process's RSS settles in steps first); the warm-up at most 10 minutes."""
    return min(max(duration_s / 5, 120.0), 600.0), max(120.0, duration_s / 5)


def default_fault_every_s(duration_s: float) -> float:
    return 180.0 if duration_s >= 4 * 180 else duration_s / 4


async def _inject_faults(ctx: Ctx, every_s: float, end: float, t0: float, log: list[dict[str, Any]]) -> None:
    """One fault every `every_s` seconds, in turn, until `end`; each one runs to its recovery."""
    faults: list[Scenario] = []
    by_name = {sc.name: sc for sc in SCENARIOS}
    for sc in (by_name[name] for name in _FAULTS):
        if (why := sc.skip(ctx.cfg)) is None:
            faults.append(sc)
        else:
            log.append({"fault": sc.name, "skipped": why})
    k = 0
    while faults and time.monotonic() + every_s < end:
        await asyncio.sleep(every_s)  # the soak's rhythm is wall-clock time on purpose
        sc = faults[k % len(faults)]
        k += 1
        entry: dict[str, Any] = {"t": round(time.monotonic() - t0, 1), "fault": sc.name}
        try:
            entry["note"] = await sc.inject(ctx)
        except Exception as exc:  # noqa: BLE001 - recorded and reported; the soak goes on
            entry["error"] = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await ctx.view.disarm()
        entry["healed_t"] = round(time.monotonic() - t0, 1)
        log.append(entry)
        print(f"soak: t={entry['t']:.0f}s {sc.name}: {entry.get('note') or entry.get('error')}", flush=True)


async def soak(cfg: CrossfillConfig, up: UpProcess, view: ClusterView, work: Workloads, p: Params, minutes: float,
               out: Path, sample_s: float = 10.0, fault_every_s: float | None = None) -> SoakReport:
    out.mkdir(parents=True, exist_ok=True)
    duration = minutes * 60
    every = fault_every_s or default_fault_every_s(duration)
    # Rate drops last until a few answers come back; in a soak a handful is enough.
    fp = replace(p, after=min(p.after, 4), repeats=1)
    load = LoadGenerator(view.gateway_url, cfg.model.api_name, work.mixes["soak"].next_job, p.concurrency,
                         p.deadline_s, connect_budget_s=p.wait_s, api_key=view.api_key)
    t0 = time.monotonic()
    sampler = Sampler(up, view, t0)
    faults: list[dict[str, Any]] = []
    stop = asyncio.Event()
    await load.start()
    sampling = asyncio.create_task(sampler.run(sample_s, stop))
    injecting = asyncio.create_task(_inject_faults(Ctx(cfg, up, view, load, fp), every, t0 + duration, t0, faults))
    await asyncio.sleep(duration)
    await injecting  # a fault under way runs to its recovery (bounded by its own waits)
    outcomes = await load.stop()
    stop.set()
    await sampling
    release = await view.wait_kv_released(p.drain_s)
    row = tally("soak", outcomes, work.refs, release.leaked, f"{sum('t' in f for f in faults)} fault(s)")
    row.error = "; ".join(f"{f['fault']}: {f['error']}" for f in faults if "error" in f) or None
    warmup, min_span = warmup_and_span(duration)
    disturbed = [(f["t"], f["healed_t"] + _SETTLE_S) for f in faults if "t" in f]
    report = SoakReport(row, trends(sampler.procs, warmup, min_span, disturbed))
    _write(out, cfg, minutes, report, sampler, faults, warmup)
    return report


def _write(out: Path, cfg: CrossfillConfig, minutes: float, report: SoakReport, sampler: Sampler,
           faults: list[dict[str, Any]], warmup: float) -> None:
    processes: dict[str, dict[str, Any]] = {}
    for s in sampler.procs:
        p = processes.setdefault(s.name, {"pids": [], "rss_mb_max": 0.0, "fds_max": 0, "threads_max": 0})
        if s.pid not in p["pids"]:
            p["pids"].append(s.pid)
        p["rss_mb_max"] = max(p["rss_mb_max"], round(s.rss / 2**20, 1))
        p["fds_max"], p["threads_max"] = max(p["fds_max"], s.fds), max(p["threads_max"], s.threads)
    summary = {
        "model": cfg.model.name, "minutes": minutes, "warmup_s": warmup, "settle_s": _SETTLE_S, "ok": report.ok,
        "requests": report.row.as_dict(), "trends": [t.as_dict() for t in report.trends],
        "processes": processes, "faults": faults,
        "kv_blocks_max": {k.name: max(x.blocks_used for x in sampler.kv if x.name == k.name) for k in sampler.kv},
        "samples": [asdict(s) for s in sampler.procs], "kv_samples": [asdict(k) for k in sampler.kv],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_soak(out, sampler.procs, sampler.kv, [(f["t"], f["fault"]) for f in faults if "t" in f])


def render_trends(report: SoakReport) -> str:
    lines = [f"{'process':<22} {'pid':>7} {'metric':<8} {'slope/h (±2 se)':>20} {'bound/h':>8} {'quiet':>6}  "
             "verdict"]
    for t in report.trends:
        value = "-" if t.slope_per_h is None else f"{t.slope_per_h:+.1f} ±{2 * t.stderr_per_h:.1f}"
        lines.append(f"{t.process:<22} {t.pid:>7} {t.metric:<8} {value:>20} {t.bound:>8g} {t.span_s:>5.0f}s  "
                     f"{t.verdict}")
    return "\n".join(lines)


async def _run(config: str, minutes: float, out: Path, sample_s: float, fault_every_s: float | None) -> SoakReport:
    cfg = load_config(config)
    print(f"soak: computing the greedy reference with {cfg.model.name} ...", flush=True)
    work = await asyncio.to_thread(build_workloads, cfg, FULL, f"soak{int(time.time())}", ("soak",))
    up = UpProcess(config, out / "up.log")
    view = ClusterView(cfg)
    try:
        print(f"soak: starting crossfill up (log: {up.log_path})", flush=True)
        await up.start(cfg.serving.startup_timeout_s)
        await until("the cluster is ready", view.cluster_ready, FULL.wait_s)
        print(f"soak: {minutes:g} min of load from now", flush=True)
        return await soak(cfg, up, view, work, FULL, minutes, out, sample_s, fault_every_s)
    finally:
        await view.close()
        await asyncio.to_thread(up.stop, cfg.serving.drain_timeout_s + 30)


def run_soak(config: str, minutes: float, out: str, sample_s: float, fault_every_s: float | None) -> int:
    try:
        load_config(config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    try:
        report = asyncio.run(_run(config, minutes, Path(out), sample_s, fault_every_s))
    except ClusterDidNotStart as exc:
        print(f"soak: the cluster did not start, nothing was run: {exc}", file=sys.stderr)
        return 2
    print()
    print(render_text([report.row]))
    print()
    print(render_trends(report))
    verdict = "PASS" if report.ok else "FAIL"
    unsure = sum(t.verdict in ("n/a", "inconclusive") for t in report.trends)
    if report.ok and unsure:
        verdict += f" ({unsure} of {len(report.trends)} trends inconclusive or too short to judge: run longer)"
    print(f"\nsoak: {verdict}; summary and plots in {out}/")
    return 0 if report.ok else 1
