"""`crossfill chaos`: every scenario of `scenarios.py` under steady load, one table row each.

Per scenario: start the load (a fresh set of clients), wait for a few completions, inject the
fault and wait for recovery, wait until requests sent after recovery complete, stop the load
(in-flight requests end), then wait for every worker to release its KV. The row counts what the
clients saw; the run fails (exit status 1) when any request was lost, duplicated or wrong, any KV
block leaked, or a scenario could not be carried out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from crossfill.config import ConfigError, CrossfillConfig, load_config
from crossfill.reliability.cluster import ClusterView
from crossfill.reliability.load import LoadGenerator, until
from crossfill.reliability.mixes import CHAOS_MIXES, Workloads, build_workloads
from crossfill.reliability.procs import ClusterDidNotStart, UpProcess
from crossfill.reliability.scenarios import FULL, SCENARIOS, SHORT, Ctx, Params, Scenario, capacity
from crossfill.reliability.verdict import Row, render_markdown, render_text, tally

_HARNESS_ERRORS = (TimeoutError, RuntimeError, httpx.HTTPError, psutil.Error, KeyError, ValueError)


async def run_scenario(sc: Scenario, cfg: CrossfillConfig, up: UpProcess, view: ClusterView, w: Workloads,
                       p: Params) -> Row:
    why = sc.skip(cfg)
    if why:
        return Row(sc.name, skipped=why)
    if not up.alive():
        return Row(sc.name, error="crossfill up is not running")
    try:
        await until("the cluster is ready (every instance healthy, gateway ready)", view.cluster_ready, p.wait_s)
    except TimeoutError as exc:
        return Row(sc.name, error=str(exc))
    concurrency = 3 * capacity(cfg) if sc.mix == "overload" else p.concurrency
    load = LoadGenerator(view.gateway_url, cfg.model.api_name, w.mixes[sc.mix].next_job, concurrency,
                         p.deadline_s, connect_budget_s=p.wait_s, api_key=view.api_key)
    error, note = None, ""
    await load.start()
    try:
        await until(f"{p.warm} completions before the fault",
                    lambda: load.count(lambda o: o.verdict == "completed") >= p.warm, p.wait_s, load=load)
        note = await sc.inject(Ctx(cfg, up, view, load, p))
        healed = time.monotonic()
        await until(f"{p.after} requests sent after recovery complete",
                    lambda: load.completed_since(healed) >= p.after, p.wait_s, load=load)
    except _HARNESS_ERRORS as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        outcomes = await load.stop()
        with contextlib.suppress(*_HARNESS_ERRORS):
            await view.disarm()  # never leave a fault armed for the next scenario
    release = await view.wait_kv_released(p.drain_s)
    row = tally(sc.name, outcomes, w.refs, release.leaked, note)
    if release.leaked != 0:
        row.notes += f"; still held after {p.drain_s:g}s: {release.describe()}"
    row.error = error
    return row


async def run_matrix(cfg: CrossfillConfig, up: UpProcess, view: ClusterView, w: Workloads, p: Params,
                     names: list[str] | None = None, say: Callable[[str], None] = print) -> list[Row]:
    chosen = [s for s in SCENARIOS if not names or s.name in names]
    unknown = set(names or []) - {s.name for s in SCENARIOS}
    if unknown:
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
    rows = []
    for sc in chosen:
        say(f"chaos: {sc.name} ...")
        row = await run_scenario(sc, cfg, up, view, w, p)
        say(render_text([row]).splitlines()[1])
        rows.append(row)
    return rows


async def _run(config: str, p: Params, names: list[str] | None, out_dir: Path) -> list[Row]:
    cfg = load_config(config)
    print(f"chaos: computing the greedy reference with {cfg.model.name} ...", flush=True)
    w = await asyncio.to_thread(build_workloads, cfg, p, f"chaos{int(time.time())}", CHAOS_MIXES)
    up = UpProcess(config, out_dir / "up.log")
    view = ClusterView(cfg)
    try:
        print(f"chaos: starting crossfill up (log: {up.log_path})", flush=True)
        await up.start(cfg.serving.startup_timeout_s)
        return await run_matrix(cfg, up, view, w, p, names, say=lambda s: print(s, flush=True))
    finally:
        await view.close()
        await asyncio.to_thread(up.stop, cfg.serving.drain_timeout_s + 30)


def run_chaos(config: str, short: bool, names: list[str] | None, json_out: str | None, markdown_out: str | None,
              out_dir: str) -> int:
    unknown = set(names or []) - {s.name for s in SCENARIOS}
    if unknown:
        print(f"chaos: unknown scenario(s) {', '.join(sorted(unknown))}; known: "
              f"{', '.join(s.name for s in SCENARIOS)}", file=sys.stderr)
        return 2
    try:
        load_config(config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    p = SHORT if short else FULL
    try:
        rows = asyncio.run(_run(config, p, names, Path(out_dir)))
    except ClusterDidNotStart as exc:
        print(f"chaos: the cluster did not start, nothing was run: {exc}", file=sys.stderr)
        return 2
    print()
    print(render_text(rows))
    if markdown_out:
        Path(markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_out).write_text(render_markdown(rows))
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps({"config": config, "short": short, "ok": all(r.ok for r in rows),
                                              "rows": [r.as_dict() for r in rows]}, indent=2))
    bad = [r.scenario for r in rows if not r.ok]
    print(f"\nchaos: {'FAILED: ' + ', '.join(bad) if bad else 'all scenarios clean'}")
    return 1 if bad else 0
