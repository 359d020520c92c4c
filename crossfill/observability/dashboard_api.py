"""The gateway's live dashboard: the page at `/dashboard/`, the JSON it polls at `/dashboard/api/state`.

The page is static (`dashboard/`: index.html, app.js, style.css and uPlot, vendored from npm; no
build step). Every ~2 s it fetches the state below and keeps its time series itself, so the
gateway holds no history beyond a bounded ring of the last finished requests.

The state joins what the gateway knows itself (readiness, requests in flight, the route reports
of its last `RECENT_MAX` requests: route, rule (bounded label) and reason, instances, TTFT, tokens, KV raw/wire bytes, error
code; never prompt or output text, nor an error's message, which may quote the request) with the
scheduler's `GET /v1/admin/cluster` (instances with role, health, queue and KV blocks; each
link's RTT, bandwidth, loss and breaker). The scheduler is asked with the gateway's own client
(mutual TLS when on) and the caller's key: the state shows the whole cluster, so with
`security.auth` on it takes an admin key, here and at the scheduler's admin API alike. The static
files take none (they hold no data); the page asks for the key.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from crossfill.config import CrossfillConfig
from crossfill.observability.route_reasons import reason_label
from crossfill.security.auth import Authenticator, presented_key
from crossfill.serving.health import Readiness
from crossfill.serving.protocol import RouteInfo, Usage
from crossfill.serving.worker_common import InFlight

STATIC_DIR = Path(__file__).parent / "dashboard"
RECENT_MAX = 200  # finished requests kept for the page: enough for a few minutes of a demo's traffic
_SCHEDULER_TIMEOUT_S = 3.0  # the page polls every 2 s: a slow scheduler shows as an error, not a pile-up


class RecentRoutes:
    """The route reports of the last `maxlen` finished requests, and running totals since start.

    Each entry has a `seq` that only grows, so the page adds each request to its charts once
    however often it sees it. `clock` (wall time, for the page's time axis) is injectable for tests.
    """

    def __init__(self, maxlen: int = RECENT_MAX, clock: Callable[[], float] = time.time) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._clock = clock
        self._seq = 0
        self.totals: Counter[str] = Counter()  # requests, errors, tokens and KV bytes since the gateway started

    def add(self, info: RouteInfo, outcome: str, error_code: str | None, usage: Usage | None = None) -> None:
        self._seq += 1
        route = info.route if info.decode_instance or info.prefill_instance else "none"
        t = info.timings_ms
        entry = {
            "seq": self._seq, "time": self._clock(), "request_id": info.request_id, "tenant_id": info.tenant_id,
            "route": route, "rule": reason_label(info.route_reason) if info.route_reason else None,
            "reason": info.route_reason, "degradation_reason": info.degradation_reason,
            "prefill_instance": info.prefill_instance, "decode_instance": info.decode_instance,
            "transport": info.transport, "outcome": outcome, "error_code": error_code, "retries": info.retries,
            "ttft_ms": t.get("first_token"), "total_ms": t.get("total"),
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "completion_tokens": usage.completion_tokens if usage else 0,
            "prefill_cached_tokens": info.prefill_cached_tokens, "decode_cached_tokens": info.decode_cached_tokens,
            "kv_raw_bytes": info.kv_raw_bytes, "kv_wire_bytes": info.kv_wire_bytes,
        }
        self._entries.append(entry)
        self.totals.update({"requests": 1, f"route_{route}": 1, "errors": int(outcome != "ok"),
                            "completion_tokens": entry["completion_tokens"], "prompt_tokens": entry["prompt_tokens"],
                            "kv_raw_bytes": info.kv_raw_bytes, "kv_wire_bytes": info.kv_wire_bytes})

    def entries(self) -> list[dict[str, Any]]:
        return list(self._entries)


class DashboardSource(Protocol):
    """What the dashboard reads from the gateway (crossfill.serving.gateway.Gateway)."""

    cfg: CrossfillConfig
    auth: Authenticator
    readiness: Readiness
    recent: RecentRoutes
    requests: InFlight
    http: httpx.AsyncClient | None
    scheduler_url: str


async def scheduler_cluster(gw: DashboardSource, key: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The scheduler's `/v1/admin/cluster`, or None and why not (the page shows the reason)."""
    if gw.http is None:
        return None, "the gateway is starting"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = await gw.http.get(gw.scheduler_url + "/v1/admin/cluster", headers=headers, timeout=_SCHEDULER_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return None, f"scheduler unreachable: {type(exc).__name__}"
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code != 200 or not isinstance(body, dict):
        msg = (body or {}).get("error", {}).get("message") if isinstance(body, dict) else None
        return None, f"scheduler answered HTTP {r.status_code}" + (f": {msg}" if msg else "")
    return body, None


async def dashboard_state(gw: DashboardSource, key: str | None) -> dict[str, Any]:
    cfg = gw.cfg
    cluster, error = await scheduler_cluster(gw, key)
    return {
        "time": time.time(),
        "gateway": {"ready": gw.readiness.ready, "reason": gw.readiness.reason, "in_flight": gw.requests.count,
                    "model": cfg.model.api_name, "local_datacenter": cfg.topology.local_datacenter},
        "datacenters": sorted(cfg.topology.datacenters),
        "cluster": cluster,
        "cluster_error": error,
        "recent": gw.recent.entries(),
        "totals": dict(gw.recent.totals),
    }


def add_dashboard_routes(app: FastAPI, gw: DashboardSource) -> None:
    """Mount the page, its assets and its JSON (none of them in the OpenAPI document: not part of the API)."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_root(request: Request) -> RedirectResponse:
        # The page and its assets use relative URLs, so they work under any prefix a proxy adds.
        query = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"{request.url.path}/{query}", status_code=307)

    @app.get("/dashboard/", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-cache"})

    @app.get("/dashboard/api/state", include_in_schema=False)
    async def dashboard_api_state(request: Request) -> dict[str, Any]:
        gw.auth.require_admin(request)  # 401 / 403 in OpenAI's form; nothing when auth is off
        return await dashboard_state(gw, presented_key(request.headers))

    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
