"""`crossfill diagnose`: read a running cluster and apply M8's troubleshooting table to it.

What it reads
-------------
With `--config FILE` it knows every address: each service's `/metrics` (gateway, scheduler, every
prefill and decode instance, and instances added at run time, which the scheduler lists), each
worker's `/v1/admin/stats`, and the scheduler's `/v1/admin/cluster` (health, queues, link
estimates) and `/v1/admin/plan` (the planner's recommendation). Internal services are called
directly (never through a WAN emulator) with the operator certificate under mutual TLS, and the
scheduler's admin endpoints with an admin API key (`--api-key`, else the config's first admin dev
key) when `security.auth` is on. With `--url GATEWAY` alone it reads the gateway's `/metrics` only,
which is enough for the rules that look at the gateway's counters.

Rates
-----
Counters only mean something as they change, so diagnose takes two snapshots `--window` seconds
apart (default 5) and judges each counter by how much it grew in between; state (queue depths,
KV blocks, link verdicts) is taken from the later snapshot. `--window 0` reads once and judges
counters by their totals since each process started. `--save FILE` keeps the (later) snapshot;
`--baseline FILE` compares the cluster now with such a saved snapshot instead of waiting, to ask
"what went wrong since then".

The table itself (`crossfill.observability.diagnose_rules`) is pure: every rule is tested on
snapshots built in the test, and on a live cluster.

Exit status: 0 no finding, 1 findings, 2 nothing could be read (bad config, unreachable gateway).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from crossfill.config import CrossfillConfig
from crossfill.observability.diagnose_rules import Facts, Finding, Sample, Service, Snapshot, Window, evaluate

_TIMEOUT_S = 10.0  # a busy 2-core machine answers late; a dead process refuses at once


@dataclass(frozen=True)
class Target:
    name: str
    role: str
    datacenter: str | None
    url: str


@dataclass(frozen=True)
class Sources:
    """Where diagnose reads: the services, the scheduler (None: unknown), and how to call them."""

    targets: tuple[Target, ...]
    scheduler_url: str | None = None
    facts: Facts = Facts()
    tls: dict[str, Any] | None = None  # httpx arguments (the operator certificate under mutual TLS)
    admin_headers: dict[str, str] | None = None

    @classmethod
    def from_config(cls, cfg: CrossfillConfig, api_key: str | None = None) -> Sources:
        from crossfill.security.keys import client_api_key
        from crossfill.security.tls_http import operator_kwargs

        svc = cfg.inference_service
        facts = Facts(threshold_tokens=svc.routing.long_context_threshold_tokens,
                      compression_enabled=svc.kv_cache.compression_enabled, max_retry=svc.kv_cache.max_retry,
                      timeout_ms=svc.kv_cache.timeout_ms)
        key = api_key or client_api_key(cfg, admin=True)
        # Each instance at its own address: reading through the WAN emulator would load the link it judges.
        targets = tuple(Target(i.name, i.role, i.datacenter, i.url) for i in cfg.instances())
        return cls(targets, cfg.scheduler_url(), facts, operator_kwargs(cfg),
                   {"Authorization": f"Bearer {key}"} if key else {})

    @classmethod
    def gateway_only(cls, url: str) -> Sources:
        return cls((Target("gateway", "gateway", None, url.rstrip("/")),))


def parse_metrics(text: str) -> tuple[Sample, ...]:
    """Prometheus text exposition -> samples (`_created` timestamps left out: they are not values)."""
    return tuple((s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text)
                 for s in fam.samples if not s.name.endswith("_created"))


async def _get_json(client: httpx.AsyncClient, url: str, **kw: Any) -> dict[str, Any]:
    r = await client.get(url, **kw)
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}: HTTP {r.status_code} {r.text[:200]}")
    body = r.json()
    if not isinstance(body, dict):
        raise RuntimeError(f"GET {url}: not a JSON object")
    return body


async def _read_service(client: httpx.AsyncClient, t: Target) -> Service:
    errors = []
    samples = stats = None
    try:
        r = await client.get(t.url + "/metrics")
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        samples = parse_metrics(r.text)
    except Exception as exc:  # noqa: BLE001 - an unreadable service is itself a finding
        errors.append(f"/metrics unreadable ({type(exc).__name__}: {exc})")
    if t.role in ("prefill", "decode"):
        try:
            stats = await _get_json(client, t.url + "/v1/admin/stats")
        except Exception as exc:  # noqa: BLE001 - as above
            errors.append(f"/v1/admin/stats unreadable ({type(exc).__name__}: {exc})")
    return Service(t.name, t.role, t.datacenter, samples, stats, "; ".join(errors) or None)


async def _snapshot(src: Sources) -> Snapshot:
    async with httpx.AsyncClient(timeout=_TIMEOUT_S, trust_env=False, **(src.tls or {})) as client:
        cluster = plan = None
        scheduler_error = None
        targets = list(src.targets)
        if src.scheduler_url is not None:
            try:
                cluster = await _get_json(client, src.scheduler_url + "/v1/admin/cluster", headers=src.admin_headers)
                plan = await _get_json(client, src.scheduler_url + "/v1/admin/plan", headers=src.admin_headers)
            except Exception as exc:  # noqa: BLE001 - reported with the scheduler's service entry
                scheduler_error = f"admin API unreadable ({type(exc).__name__}: {exc})"
            known = {t.name for t in targets}
            for name, inst in ((cluster or {}).get("instances") or {}).items():
                if name not in known and inst.get("state") != "drained":  # added at run time
                    targets.append(Target(name, inst["role"], inst.get("datacenter"), inst["url"]))
        services = await asyncio.gather(*(_read_service(client, t) for t in targets))
    by_name = {s.name: s for s in services}
    if scheduler_error is not None:
        for s in services:
            if s.role == "scheduler":
                by_name[s.name] = Service(s.name, s.role, s.datacenter, s.samples, s.stats,
                                          "; ".join(e for e in (s.error, scheduler_error) if e))
    return Snapshot(time.time(), by_name, cluster, plan, src.facts)


def take_snapshot(src: Sources) -> Snapshot:
    return asyncio.run(_snapshot(src))


def diagnose(src: Sources, window_s: float, baseline: Snapshot | None = None) -> tuple[Window, list[Finding]]:
    """Read the cluster (twice, `window_s` apart, unless a baseline is given) and apply the rules."""
    before = baseline
    if before is None and window_s > 0:
        before = take_snapshot(src)
        time.sleep(window_s)
    w = Window(take_snapshot(src), before)
    return w, evaluate(w)


def report(w: Window, findings: list[Finding]) -> str:
    read = [s for s in w.after.services.values() if s.samples is not None]
    head = (f"crossfill diagnose: read {len(read)} of {len(w.after.services)} services"
            f"{'' if w.after.cluster is not None else ' (no scheduler view: only metrics rules apply)'}; "
            f"counters {w.span}")
    if not findings:
        return head + "\nno findings: every M8 check passed"
    lines = [head, f"{len(findings)} finding(s):"]
    for f in findings:
        r = f.rule
        lines += ["", f"[{r.id}] {r.symptom} ({r.m8})"]
        lines += [f"  evidence: {e}" for e in f.evidence]
        lines += [f"  cause:    {r.cause}", f"  fix:      {r.fix}"]
    return "\n".join(lines)


def run_diagnose(config: str | None, url: str | None, window_s: float, baseline: str | None, save: str | None,
                 as_json: bool, api_key: str | None) -> int:
    import sys

    from crossfill.config import ConfigError, load_config

    if (config is None) == (url is None):
        print("crossfill diagnose: give --config FILE (every service) or --url GATEWAY (its metrics only)",
              file=sys.stderr)
        return 2
    try:
        src = Sources.from_config(load_config(config), api_key) if config else Sources.gateway_only(url or "")
        base = Snapshot.from_json(Path(baseline).read_text()) if baseline else None
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        print(f"crossfill diagnose: {exc}", file=sys.stderr)
        return 2
    w, findings = diagnose(src, window_s, base)
    if save:
        Path(save).write_text(w.after.to_json())
    if not any(s.samples is not None for s in w.after.services.values()) and w.after.cluster is None:
        errors = "; ".join(f"{s.name}: {s.error}" for s in w.after.services.values())
        print(f"crossfill diagnose: nothing could be read ({errors})", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"findings": [f.as_dict() for f in findings], "window": w.span}, indent=1))
    else:
        print(report(w, findings))
    return 1 if findings else 0
