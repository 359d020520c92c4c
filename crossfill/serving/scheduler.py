"""The scheduler service: health-checks every worker, watches the links, and routes requests.

It keeps a live picture of the cluster (per-instance health, readiness and queue depth from
`GET /v1/admin/stats`, per-link latency from those same probes, which cross the emulated WAN for
remote instances, and each link's bandwidth) and answers `POST /v1/route`
by running the pure policy `crossfill.policy.decide` over a snapshot of it. An instance that
fails `serving.health_check_failures` probes in a row stops receiving traffic; it gets traffic
again as soon as a probe succeeds. Until its first probe round has answered, the scheduler knows
nothing and says so (503 `not_ready`, which the gateway retries): a restarted scheduler rejoins
without routing anything on an empty picture.

Scale in and out at run time (`/v1/admin/instances`): `POST` adds a prefill or decode instance
that is not in the config file (started with `crossfill serve ROLE --instance NAME --datacenter DC
--port P`); it is probed like the others and gets traffic once ready, reached at its own address
(routes carry it to the gateway and decode). `DELETE .../{name}` drains one: no new requests go
to it, and once a probe sees it empty it is `drained` and can be stopped without dropping a
request. `POST` of a drained name takes it back. The last active decode instance cannot be removed.

Latency: a link's one-way latency is half the *minimum* round trip of the last
`_LATENCY_WINDOW` probes. A probe's round trip includes the time both event loops took to get to
it, so on a loaded machine single probes come back late while the link itself did not change;
the minimum of a window ignores those and still follows a sustained change within the window.

Bandwidth: routing checks `network.min_bandwidth_gbps` against the link's declared capacity (its
`bandwidth_gbps` in the topology), which an operator or an external monitor can change at run time
with `POST /v1/admin/links/{datacenter}`. The goodput of real transfers, which decode reports, is
shown beside it but does not drive routing: KV is sent layer by layer while prefill computes and
written into decode's engine between its steps, so a transfer's rate is usually the prefill's or
the decode engine's, not the link's, and using it would wrongly declare fast links slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from pydantic import Field

from crossfill.config import CrossfillConfig, Instance
from crossfill.policy import InstanceState, LinkState, NoRoute, RouteRequest, Snapshot, decide
from crossfill.policy.routing import Route
from crossfill.serving.errors import APIError, install_error_handlers, parse_body
from crossfill.serving.health import Readiness, add_health_routes
from crossfill.serving.metrics import ServingMetrics, add_metrics_route
from crossfill.serving.protocol import Endpoint, RouteQuery, _Msg

log = logging.getLogger("crossfill.scheduler")

_EWMA = 0.3  # weight of the newest sample in the goodput estimate
_LATENCY_WINDOW = 10  # probes whose minimum round trip gives the link latency
_MIN_BW_SAMPLE_BYTES = 256 * 1024  # smaller transfers measure latency, not goodput


@dataclass
class _Tracked:
    inst: Instance
    url: str  # where the scheduler (in the local DC) reaches it
    dynamic: bool = False  # added through the admin API, not in the config file
    state: str = "active"  # active | draining (no new requests) | drained (empty, out of routing)
    healthy: bool = False
    ready: bool = False
    failures: int = 0
    queue_depth: int = 0
    capacity: int = 1
    routed_since_probe: int = 0  # requests sent its way since the last probe saw its queue
    last_error: str | None = None
    last_ok: float = 0.0
    kv: dict[str, int] = field(default_factory=dict)


@dataclass
class _Link:
    datacenter: str
    configured_gbps: float
    latency_ms: float | None = None
    rtt_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_LATENCY_WINDOW))
    bandwidth_gbps: float | None = None  # capacity used by routing: declared, or set via the admin API
    goodput_gbps: float | None = None  # observed on real transfers (information only, see module doc)
    up: bool = True
    transfers_ok: int = 0
    transfers_failed: int = 0


class TransferReport(_Msg):
    from_datacenter: str
    wire_bytes: int
    seconds: float  # open to commit acknowledged
    tail_seconds: float = 0.0  # last layer handed over to commit acknowledged
    ok: bool


class LinkUpdate(_Msg):
    bandwidth_gbps: float = Field(gt=0)


class InstanceSpec(Endpoint):
    """`POST /v1/admin/instances`: an instance to add (its process already started or starting)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")


class ClusterState:
    """What the scheduler knows; every field is updated by probes or reports, read by snapshot()."""

    def __init__(self, cfg: CrossfillConfig) -> None:
        self.cfg = cfg
        self.local = cfg.topology.local_datacenter
        self.workers = {i.name: _Tracked(i, cfg.http_url(i.name))
                        for i in cfg.instances() if i.role in ("prefill", "decode")}
        self.links: dict[str, _Link] = {}
        for dc in cfg.topology.datacenters:
            link = cfg.link_to_local(dc)
            if link is not None:
                self.links[dc] = _Link(dc, link.bandwidth_gbps, bandwidth_gbps=link.bandwidth_gbps)
        self.rounds = 0

    async def probe(self, client: httpx.AsyncClient, t: _Tracked) -> None:
        url = t.url + "/v1/admin/stats"
        t0 = time.perf_counter()
        try:
            resp = await client.get(url)
            rtt_ms = (time.perf_counter() - t0) * 1000
            body = resp.json()
            if resp.status_code != 200 or not isinstance(body, dict):
                raise RuntimeError(f"HTTP {resp.status_code}")
        except Exception as exc:  # noqa: BLE001 - any failure is a failed health check
            t.failures += 1
            t.last_error = f"{type(exc).__name__}: {exc}"
            if t.healthy and t.failures >= self.cfg.serving.health_check_failures:
                t.healthy = False
                log.warning("instance %s removed from routing after %d failed health checks (%s)",
                            t.inst.name, t.failures, t.last_error)
            return
        if not t.healthy:
            log.info("instance %s answers its health checks again", t.inst.name)
        t.healthy, t.failures, t.last_error, t.last_ok = True, 0, None, time.time()
        t.ready = bool(body.get("ready"))
        t.queue_depth = int(body.get("queue_depth", 0))
        if t.state == "draining" and t.queue_depth == 0 and t.routed_since_probe == 0:
            t.state = "drained"
            log.warning("instance %s drained: no request left on it, it can be stopped", t.inst.name)
        t.capacity = int(body.get("capacity", 1))
        t.kv = dict(body.get("kv", {}))
        t.routed_since_probe = 0
        link = self.links.get(t.inst.datacenter)
        if link is not None:
            link.rtt_ms.append(rtt_ms)
            link.latency_ms = min(link.rtt_ms) / 2

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.probe(client, t) for t in self.workers.values()))
        for dc, link in self.links.items():
            remote = [t for t in self.workers.values() if t.inst.datacenter == dc]
            # The link is down when nothing behind it answers (instances themselves may just be busy).
            link.up = not remote or any(t.healthy for t in remote)
        self.rounds += 1

    def report_transfer(self, r: TransferReport) -> None:
        link = self.links.get(r.from_datacenter)
        if link is None:
            return
        if not r.ok:
            link.transfers_failed += 1
            return
        link.transfers_ok += 1
        if r.wire_bytes >= _MIN_BW_SAMPLE_BYTES and r.seconds > 0:
            gbps = r.wire_bytes * 8 / r.seconds / 1e9
            link.goodput_gbps = gbps if link.goodput_gbps is None else (1 - _EWMA) * link.goodput_gbps + _EWMA * gbps

    def snapshot(self) -> Snapshot:
        states = []
        for t in self.workers.values():
            if t.state == "drained":
                continue
            states.append(InstanceState(
                name=t.inst.name, role=t.inst.role, datacenter=t.inst.datacenter,  # type: ignore[arg-type]
                healthy=t.healthy and t.state == "active", ready=t.ready, queue_depth=t.queue_depth,
                capacity=t.capacity, pending=t.routed_since_probe))
        links = tuple(LinkState(dc, bandwidth_gbps=lk.bandwidth_gbps, latency_ms=lk.latency_ms, up=lk.up)
                      for dc, lk in self.links.items())
        return Snapshot(self.local, tuple(states), links)

    # -- scale in and out ----------------------------------------------------------------------
    def add(self, spec: InstanceSpec) -> _Tracked:
        """Register `spec` (scale out), or take a draining/drained instance of that name back."""
        t = self.workers.get(spec.name)
        if t is not None:
            if t.state == "active":
                raise APIError(409, f"instance {spec.name!r} is already serving", param="name",
                               code="instance_exists")
            t.state = "active"
            log.warning("instance %s taken back into routing by the admin API", spec.name)
            return t
        if spec.datacenter not in self.cfg.topology.datacenters:
            raise APIError(400, f"unknown datacenter {spec.datacenter!r}; known: "
                           f"{sorted(self.cfg.topology.datacenters)}", param="datacenter", code="unknown_datacenter")
        if spec.role == "decode" and spec.datacenter != self.local:
            raise APIError(400, f"decode instances serve the local datacenter {self.local!r}", param="datacenter",
                           code="invalid_value")
        if spec.role == "decode" and spec.kv_port is None:
            raise APIError(400, "a decode instance needs kv_port (where prefill sends its KV)", param="kv_port",
                           code="missing_field")
        inst = Instance(spec.name, spec.role, spec.datacenter, spec.host, spec.port, spec.kv_port)
        t = self.workers[spec.name] = _Tracked(inst, inst.url, dynamic=True)
        log.warning("instance %s (%s in %s at %s) added by the admin API; routing to it once it is ready",
                    spec.name, spec.role, spec.datacenter, inst.url)
        return t

    def drain(self, name: str) -> _Tracked:
        """Scale in: stop routing new requests to `name`; it is `drained` once a probe sees it empty."""
        t = self.workers.get(name)
        if t is None:
            raise APIError(404, f"no instance named {name!r}; known: {sorted(self.workers)}", param="name",
                           code="unknown_instance")
        if t.inst.role == "decode" and t.state == "active" and not any(
                o.inst.role == "decode" and o.state == "active" for o in self.workers.values() if o is not t):
            raise APIError(409, f"{name} is the last active decode instance; add another before removing it",
                           param="name", code="last_decode_instance")
        if t.state == "active":
            t.state = "draining"
            log.warning("instance %s draining (admin API): no new requests; %d in flight", name, t.queue_depth)
        return t

    def endpoints(self, route: Route) -> dict[str, Endpoint]:
        """Addresses of the route's instances that other processes cannot find in the config file."""
        out: dict[str, Endpoint] = {}
        for name in (route.prefill, route.decode, *route.fallbacks):
            t = self.workers.get(name)
            if t is not None and t.dynamic:
                i = t.inst
                out[name] = Endpoint(role=i.role, datacenter=i.datacenter, host=i.host, port=i.port,  # type: ignore[arg-type]
                                     kv_port=i.kv_port)
        return out

    def instance_dict(self, t: _Tracked) -> dict[str, object]:
        return {"role": t.inst.role, "datacenter": t.inst.datacenter, "url": t.inst.url, "state": t.state,
                "added_at_run_time": t.dynamic, "healthy": t.healthy, "ready": t.ready,
                "queue_depth": t.queue_depth, "capacity": t.capacity, "failures": t.failures,
                "last_error": t.last_error, "kv": t.kv}

    def note_routed(self, name: str) -> None:
        t = self.workers.get(name)
        if t is not None:
            t.routed_since_probe += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "local_datacenter": self.local,
            "probe_rounds": self.rounds,
            "instances": {n: self.instance_dict(t) for n, t in self.workers.items()},
            "links": {
                dc: {"up": lk.up, "latency_ms": lk.latency_ms, "bandwidth_gbps": lk.bandwidth_gbps,
                     "configured_bandwidth_gbps": lk.configured_gbps, "goodput_gbps": lk.goodput_gbps,
                     "transfers_ok": lk.transfers_ok,
                     "transfers_failed": lk.transfers_failed}
                for dc, lk in self.links.items()
            },
        }


def avoiding(snap: Snapshot, names: list[str]) -> Snapshot:
    """`snap` with the decode instances in `names` taken out, unless that would leave none available."""
    if not names:
        return snap
    others = [s for s in snap.instances if s.role == "decode" and s.available and s.name not in names]
    if not others:
        return snap
    instances = tuple(dataclasses.replace(s, healthy=False) if s.role == "decode" and s.name in names else s
                      for s in snap.instances)
    return dataclasses.replace(snap, instances=instances)


def create_scheduler_app(cfg: CrossfillConfig) -> FastAPI:
    state = ClusterState(cfg)
    readiness = Readiness("scheduler", "scheduler")
    metrics = ServingMetrics()
    interval = cfg.serving.health_check_interval_ms / 1000

    async def poll_forever() -> None:
        # Generous: a busy worker (2 cores shared by everything) is slow, not dead.
        timeout = httpx.Timeout(max(interval * 4, 2.0))
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            while True:
                await state.probe_all(client)
                snap = state.snapshot()
                decode_ok = any(s.available for s in snap.instances if s.role == "decode")
                if decode_ok:
                    readiness.set_ready()
                else:
                    readiness.set_not_ready("no decode instance is healthy and ready")
                await asyncio.sleep(interval)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(poll_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="crossfill scheduler", lifespan=lifespan)
    install_error_handlers(app)
    add_health_routes(app, readiness)
    add_metrics_route(app, metrics, cfg.inference_service.observability.metrics_enabled)

    @app.post("/v1/route")
    async def route(request: Request) -> dict[str, object]:
        q = await parse_body(request, RouteQuery)
        if state.rounds == 0:
            raise APIError(503, "the scheduler is starting: no health probe round has answered yet",
                           code="not_ready", retry_after=cfg.serving.retry_after_s)
        try:
            r = decide(RouteRequest(q.prompt_tokens, q.prefill_policy, q.tenant_id),  # type: ignore[arg-type]
                       avoiding(state.snapshot(), q.avoid_decode), cfg.inference_service)
        except NoRoute as exc:
            retry = cfg.serving.retry_after_s if exc.status in (429, 503) else None
            metrics.errors.labels(exc.code).inc()
            raise APIError(exc.status, exc.message, code=exc.code, retry_after=retry,
                           param="prefill_policy" if exc.status == 400 else None) from None
        state.note_routed(r.prefill)
        state.note_routed(r.decode)
        if r.degradation_reason:
            metrics.fallbacks.labels("routing").inc()
            log.warning("request %s degraded at routing: %s", q.request_id, r.degradation_reason)
        log.info("route %s: %s prefill=%s decode=%s (%s)", q.request_id, r.kind, r.prefill, r.decode, r.reason)
        out: dict[str, object] = dataclasses.asdict(r)
        endpoints = state.endpoints(r)
        if endpoints:
            out["endpoints"] = {n: e.model_dump() for n, e in endpoints.items()}
        return out

    @app.post("/v1/report/transfer")
    async def report(request: Request) -> dict[str, bool]:
        state.report_transfer(await parse_body(request, TransferReport))
        return {"ok": True}

    @app.post("/v1/admin/links/{datacenter}")
    async def set_link(datacenter: str, request: Request) -> dict[str, object]:
        body = await parse_body(request, LinkUpdate)
        link = state.links.get(datacenter)
        if link is None:
            raise APIError(404, f"no link from {datacenter!r} to {state.local}; links: {sorted(state.links)}",
                           param="datacenter", code="unknown_link")
        link.bandwidth_gbps = body.bandwidth_gbps
        log.warning("link %s: bandwidth set to %g Gbit/s by the admin API", datacenter, body.bandwidth_gbps)
        return state.as_dict()["links"][datacenter]  # type: ignore[index]

    @app.get("/v1/admin/instances")
    async def list_instances() -> dict[str, object]:
        return {n: state.instance_dict(t) for n, t in state.workers.items()}

    @app.post("/v1/admin/instances")
    async def add_instance(request: Request) -> dict[str, object]:
        t = state.add(await parse_body(request, InstanceSpec))
        return {"name": t.inst.name, **state.instance_dict(t)}

    @app.delete("/v1/admin/instances/{name}")
    async def drain_instance(name: str) -> dict[str, object]:
        t = state.drain(name)
        return {"name": name, **state.instance_dict(t)}

    @app.get("/v1/admin/cluster")
    async def cluster() -> dict[str, object]:
        return state.as_dict()

    app.state.cluster = state
    return app
