"""The cluster as the harness watches and steers it over HTTP: the scheduler's view, the gateway's
readiness, every worker's KV blocks, and the WAN emulators' control APIs (one per crossing)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from crossfill.config import CrossfillConfig, Crossing
from crossfill.security.keys import client_api_key
from crossfill.security.tls_http import operator_kwargs


@dataclass
class KVRelease:
    """KV still held once the load stopped: per worker (blocks_used, active_requests), or None if it never answered."""

    workers: dict[str, tuple[int, int] | None]

    @property
    def leaked(self) -> int | None:
        if any(v is None for v in self.workers.values()):
            return None
        return sum(v[0] for v in self.workers.values() if v is not None)

    def describe(self) -> str:
        held = {n: v for n, v in self.workers.items() if v != (0, 0)}
        return ", ".join(f"{n}: {'no answer' if v is None else f'{v[0]} blocks, {v[1]} requests'}"
                         for n, v in held.items())


class ClusterView:
    def __init__(self, cfg: CrossfillConfig) -> None:
        self.cfg = cfg
        topo = cfg.topology
        self.gateway_url = f"http://{topo.gateway.host}:{topo.gateway.port}"
        self.scheduler_url = cfg.scheduler_url()
        self.workers = [i.name for i in cfg.instances() if i.role in ("prefill", "decode")]
        self.remote_prefills = [i.name for i in cfg.prefill_instances()
                                if i.datacenter != topo.local_datacenter]
        self.decodes = [i.name for i in cfg.decode_instances()]
        # With security.auth on: the config's dev keys, a tenant's for the load, an admin's for the scheduler's view.
        self.api_key = client_api_key(cfg)
        admin = client_api_key(cfg, admin=True)
        self.admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        # No keep-alive: a pooled connection to a process that was just restarted would fail its next call.
        # The operator certificate when services run mutual TLS (the gateway's own port is plain).
        self.http = httpx.AsyncClient(trust_env=False, timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0),
                                      **operator_kwargs(cfg))

    async def close(self) -> None:
        await self.http.aclose()

    # -- health ---------------------------------------------------------------------------------
    async def scheduler_view(self) -> dict[str, Any]:
        return (await self.http.get(self.scheduler_url + "/v1/admin/cluster", headers=self.admin_headers)).json()

    async def all_healthy(self) -> bool:
        """The scheduler routes to every instance again (each healthy and ready in its view)."""
        r = await self.http.get(self.scheduler_url + "/readyz")
        if r.status_code != 200:
            return False
        view = await self.scheduler_view()
        return all(i["healthy"] and i["ready"] for i in view["instances"].values())

    async def instance_healthy(self, name: str) -> bool:
        inst = (await self.scheduler_view())["instances"][name]
        return bool(inst["healthy"] and inst["ready"])

    async def gateway_ready(self) -> bool:
        return (await self.http.get(self.gateway_url + "/readyz")).status_code == 200

    async def cluster_ready(self) -> bool:
        return await self.gateway_ready() and await self.all_healthy()

    async def worker_stats(self, name: str) -> dict[str, Any]:
        return (await self.http.get(self.cfg.instance(name).url + "/v1/admin/stats")).json()

    # -- KV accounting --------------------------------------------------------------------------
    async def kv_held(self) -> KVRelease:
        held: dict[str, tuple[int, int] | None] = {}
        for name in self.workers:
            try:
                kv = (await self.http.get(self.cfg.instance(name).url + "/v1/admin/kv")).json()
                held[name] = (int(kv["blocks_used"]), int(kv["active_requests"]))
            except (httpx.HTTPError, ValueError, KeyError):
                held[name] = None  # restarting, or the engine not loaded yet
        return KVRelease(held)

    async def wait_kv_released(self, timeout_s: float) -> KVRelease:
        """Poll every worker until none holds a block or a request (cleanup after aborts runs in the
        background); what is still held when `timeout_s` passes is the leak."""
        deadline = time.monotonic() + timeout_s
        while True:
            release = await self.kv_held()
            if release.leaked == 0 and all(v == (0, 0) for v in release.workers.values()):
                return release
            if time.monotonic() > deadline:
                return release
            await asyncio.sleep(0.2)

    # -- the WAN emulators ----------------------------------------------------------------------
    def crossings(self, kind: str | None = None) -> list[Crossing]:
        return [c for c in self.cfg.crossings() if kind is None or c.kind == kind]

    def control(self, c: Crossing) -> str:
        return f"http://{c.listen_host}:{c.control_port}"

    async def arm(self, crossings: list[Crossing], **fault: Any) -> None:
        for c in crossings:
            r = await self.http.post(self.control(c) + "/faults", json=fault)
            r.raise_for_status()

    async def disarm(self, crossings: list[Crossing] | None = None) -> None:
        for c in crossings if crossings is not None else self.crossings():
            (await self.http.delete(self.control(c) + "/faults")).raise_for_status()

    async def link(self, c: Crossing) -> dict[str, Any]:
        return (await self.http.get(self.control(c) + "/link")).json()

    async def set_link(self, c: Crossing, **settings: Any) -> None:
        (await self.http.post(self.control(c) + "/link", json=settings)).raise_for_status()

    async def counter(self, crossings: list[Crossing], path: str) -> float:
        """The sum over `crossings` of a counter of GET /link, e.g. 'cuts' or 'up.corrupted_bytes'."""
        total = 0.0
        for c in crossings:
            value: Any = (await self.link(c))["counters"]
            for key in path.split("."):
                value = value[key]
            total += value
        return total

    async def faults_over(self, crossings: list[Crossing]) -> bool:
        """No stall or partition is holding traffic on `crossings` any more."""
        for c in crossings:
            f = (await self.link(c))["faults"]
            if f["stall_remaining_ms"] > 0 or f.get("partition_remaining_ms", 0) > 0:
                return False
        return True
