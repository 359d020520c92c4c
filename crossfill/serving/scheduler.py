"""The scheduler service: health-checks every worker, watches the links, indexes the KV, routes.

It keeps a live picture of the cluster and answers `POST /v1/route` by running the pure policy
`crossfill.policy.decide` over a snapshot of it:

- instances: health, readiness, queue depth and measured prefill tokens/s from `GET
  /v1/admin/stats` every `serving.health_check_interval_ms`. An instance that fails
  `serving.health_check_failures` probes in a row stops receiving traffic; it gets traffic again
  as soon as a probe succeeds. Until the first probe round has answered, the scheduler knows
  nothing and says so (503 `not_ready`, which the gateway retries);
- KV already present: the same polls carry each worker's prefix-cache events (blocks stored and
  evicted, as chain hashes), which feed a global `KVIndex`; the gateway sends the prompt's block
  hashes, so the route knows every instance's longest cached prefix of it;
- links: one `LinkWatch` per inter-DC link (`crossfill.serving.link_watch`): RTT from the health
  probes that cross it, bandwidth from an active payload probe and from decode's transfer
  reports, the circuit breaker from transfer outcomes, and the KV bytes in flight;
- the slow timescale: every `routing.retune_interval_s` the planner's model re-derives the
  threshold from the observed lengths and speeds (`crossfill.serving.retune`, `GET /v1/admin/plan`);
- batch requests the policy defers wait in `BatchQueue`, retried after every probe round.

Scale in and out at run time (`/v1/admin/instances`): `POST` adds a prefill or decode instance
that is not in the config file (started with `crossfill serve ROLE --instance NAME --datacenter DC
--port P`); it is probed like the others and gets traffic once ready, reached at its own address
(routes carry it to the gateway and decode). `DELETE .../{name}` drains one: no new requests go
to it, and once a probe sees it empty it is `drained` and can be stopped without dropping a
request. `POST` of a drained name takes it back. The last active decode instance cannot be removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from opentelemetry.context import Context
from pydantic import Field

from crossfill.config import CrossfillConfig, Instance
from crossfill.engine.block_pool import DEFAULT_BLOCK_SIZE as PREFIX_BLOCK_SIZE
from crossfill.net.probe import measure_bandwidth_paired
from crossfill.observability.collectors import ClusterCollector
from crossfill.observability.route_reasons import reason_label
from crossfill.observability.tracing import SpanKind, Tracing, end_span
from crossfill.policy import Defer, InstanceState, NoRoute, RouteRequest, Snapshot, decide
from crossfill.policy.kv_index import KVIndex
from crossfill.policy.routing import Route
from crossfill.security.audit import open_audit
from crossfill.security.auth import AdminAuth, Authenticator
from crossfill.security.tls_http import client_kwargs
from crossfill.serving.batch_queue import BatchQueue
from crossfill.serving.errors import APIError, install_error_handlers, parse_body
from crossfill.serving.health import Readiness, add_health_routes
from crossfill.serving.link_watch import LinkWatch
from crossfill.serving.metrics import ServingMetrics, add_metrics_route
from crossfill.serving.protocol import Endpoint, RouteQuery, _Msg
from crossfill.serving.retune import Retuner
from crossfill.serving.transfer_tickets import TicketGate

log = logging.getLogger("crossfill.scheduler")

_EWMA = 0.2  # weight of the newest sample in the KV-bytes-per-token estimate


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
    prefill_tokens_per_s: float | None = None  # measured by the instance itself


class TransferReport(_Msg):
    from_datacenter: str
    wire_bytes: int
    seconds: float  # open to commit acknowledged (the sender's clock: includes all wire time)
    tail_seconds: float = 0.0  # last layer handed over to commit acknowledged
    ok: bool
    request_id: str | None = None
    tokens: int = Field(0, ge=0)  # prompt tokens whose KV was sent
    frames: int = Field(0, ge=0)
    retransmits: int = Field(0, ge=0)


class LinkUpdate(_Msg):
    # An operator's capacity for the link, used instead of the estimate; null clears it.
    bandwidth_gbps: float | None = Field(gt=0)


class InstanceSpec(Endpoint):
    """`POST /v1/admin/instances`: an instance to add (its process already started or starting)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")


class ClusterState:
    """What the scheduler knows; every field is updated by probes or reports, read by snapshot()."""

    def __init__(self, cfg: CrossfillConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.local = cfg.topology.local_datacenter
        self.workers = {i.name: _Tracked(i, cfg.http_url(i.name))
                        for i in cfg.instances() if i.role in ("prefill", "decode")}
        svc = cfg.inference_service
        # A transfer report that never comes (decode died) stops counting as in flight after the
        # longest a transfer may take: every attempt's KV silence timeout.
        expire_s = svc.kv_cache.timeout_ms / 1000 * (svc.kv_cache.max_retry + 1) + 10
        self.links: dict[str, LinkWatch] = {}
        for dc in cfg.topology.datacenters:
            link = cfg.link_to_local(dc)
            if link is not None:
                self.links[dc] = LinkWatch(dc, svc.network, link.bandwidth_gbps, expire_s=expire_s, clock=clock)
        self.kv_index = KVIndex()
        self.kv_bytes_per_token: float | None = None
        self.retuner = Retuner(cfg)
        self.rounds = 0

    async def probe(self, client: httpx.AsyncClient, t: _Tracked) -> bool:
        url = t.url + "/v1/admin/stats"
        t0 = time.perf_counter()
        try:
            resp = await client.get(url, params=self.kv_index.query_params(t.inst.name))
            rtt_s = time.perf_counter() - t0
            body = resp.json()
            if resp.status_code != 200 or not isinstance(body, dict):
                raise RuntimeError(f"HTTP {resp.status_code}")
        except Exception as exc:  # noqa: BLE001 - any failure is a failed health check
            t.failures += 1
            t.last_error = f"{type(exc).__name__}: {exc}"
            if t.healthy and t.failures >= self.cfg.serving.health_check_failures:
                t.healthy = False
                self.kv_index.forget(t.inst.name)  # it may come back empty (restarted)
                log.warning("instance %s removed from routing after %d failed health checks (%s)",
                            t.inst.name, t.failures, t.last_error)
            return False
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
        tps = body.get("prefill_tokens_per_s")
        t.prefill_tokens_per_s = float(tps) if isinstance(tps, int | float) and tps > 0 else None
        if isinstance(body.get("kv_events"), dict):
            try:
                self.kv_index.update(t.inst.name, body["kv_events"])
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("instance %s sent KV events the index cannot use (%s); asking for a full set",
                            t.inst.name, exc)
                self.kv_index.forget(t.inst.name)
        t.routed_since_probe = 0
        link = self.links.get(t.inst.datacenter)
        if link is not None:
            link.monitor.record_rtt(rtt_s)
        return True

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        names = list(self.workers)
        answered = await asyncio.gather(*(self.probe(client, self.workers[n]) for n in names))
        for dc, link in self.links.items():
            behind = [ok for n, ok in zip(names, answered, strict=True) if self.workers[n].inst.datacenter == dc]
            if behind:  # reachable when anything behind it answers (instances themselves may be busy)
                link.monitor.record_probe(any(behind))
        self.rounds += 1

    async def probe_bandwidth(self, client: httpx.AsyncClient, dc: str) -> None:
        """One active bandwidth sample of the link to `dc`: a payload fetched from an instance behind it."""
        nbytes = self.cfg.inference_service.network.bandwidth_probe_bytes
        # Ready instances only: one still loading or warming its model is busy, and would read as a slow link.
        behind = sorted((t for t in self.workers.values() if t.inst.datacenter == dc and t.healthy and t.ready),
                        key=lambda t: t.queue_depth)
        if not nbytes or not behind:
            return
        url = behind[0].url + "/v1/admin/probe"

        async def fetch(n: int) -> int:
            r = await client.get(url, params={"bytes": n})
            r.raise_for_status()
            return len(r.content)

        try:
            await measure_bandwidth_paired(fetch, self.links[dc].monitor, nbytes)
        except (httpx.HTTPError, OSError) as exc:  # the health probes judge reachability
            log.debug("bandwidth probe of link %s failed: %s", dc, exc)

    def report_transfer(self, r: TransferReport) -> None:
        link = self.links.get(r.from_datacenter)
        if link is None:
            return
        link.transferred(r.request_id, r.wire_bytes, r.seconds, r.ok, frames=r.frames, retransmitted=r.retransmits)
        if r.ok and r.tokens > 0 and r.wire_bytes > 0:
            bpt = r.wire_bytes / r.tokens
            prev = self.kv_bytes_per_token
            self.kv_bytes_per_token = bpt if prev is None else (1 - _EWMA) * prev + _EWMA * bpt

    def link_gbps(self) -> float | None:
        """Bandwidth of the best link to a remote pool (estimate, or configured), for the planner."""
        values = [st.bandwidth_gbps or st.configured_bandwidth_gbps for st in (lk.state() for lk in self.links.values())]
        return max((v for v in values if v), default=None)

    def snapshot(self) -> Snapshot:
        states = []
        for t in self.workers.values():
            if t.state == "drained":
                continue
            states.append(InstanceState(
                name=t.inst.name, role=t.inst.role, datacenter=t.inst.datacenter,  # type: ignore[arg-type]
                healthy=t.healthy and t.state == "active", ready=t.ready, queue_depth=t.queue_depth,
                capacity=t.capacity, pending=t.routed_since_probe, prefill_tokens_per_s=t.prefill_tokens_per_s))
        links = tuple(lk.state() for lk in self.links.values())
        return Snapshot(self.local, tuple(states), links, kv_bytes_per_token=self.kv_bytes_per_token,
                        threshold_tokens=self.retuner.live_threshold())

    def route_request(self, q: RouteQuery) -> RouteRequest:
        """The policy's view of a route query: cached prefixes looked up in the KV index."""
        cached: dict[str, int] = {}
        bs = PREFIX_BLOCK_SIZE
        if q.prefix_hashes:
            prefills = [n for n, t in self.workers.items() if t.inst.role == "prefill"]
            cached.update(self.kv_index.cached_tokens(q.prefix_hashes, bs, prefills))
        decode_hashes = q.decode_prefix_hashes if q.decode_prefix_hashes is not None else q.prefix_hashes
        if decode_hashes:
            decodes = [n for n, t in self.workers.items() if t.inst.role == "decode"]
            cached.update(self.kv_index.cached_tokens(decode_hashes, bs, decodes))
        # The engine computes at least the prompt's last token itself: it reuses whole blocks
        # before it, never the block holding that token.
        reusable = max(q.prompt_tokens - 1, 0) // bs * bs
        cached = {name: min(tokens, reusable) for name, tokens in cached.items()}
        return RouteRequest(q.prompt_tokens, q.prefill_policy, q.tenant_id,  # type: ignore[arg-type]
                            request_type=q.request_type, cached_tokens=cached)  # type: ignore[arg-type]

    def routed(self, q: RouteQuery, r: Route) -> None:
        """Count a route: pending on its instances, its KV in flight on the link, its length for retuning."""
        self.note_routed(r.prefill)
        self.note_routed(r.decode)
        self.retuner.observe(q.prompt_tokens, time.monotonic())
        t = self.workers.get(r.prefill)
        if r.kind == "remote" and t is not None and t.inst.datacenter in self.links:
            bpt = self.kv_bytes_per_token or 0.0
            self.links[t.inst.datacenter].routed(q.request_id, int((q.prompt_tokens - r.decode_held_tokens) * bpt))

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
        inst = Instance(spec.name, spec.role, spec.datacenter, spec.host, spec.port, spec.kv_port,
                        self.cfg.http_scheme())
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
                "last_error": t.last_error, "kv": t.kv, "prefill_tokens_per_s": t.prefill_tokens_per_s,
                "kv_index_blocks": self.kv_index.blocks(t.inst.name)}

    def note_routed(self, name: str) -> None:
        t = self.workers.get(name)
        if t is not None:
            t.routed_since_probe += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "local_datacenter": self.local,
            "probe_rounds": self.rounds,
            "instances": {n: self.instance_dict(t) for n, t in self.workers.items()},
            "links": {dc: lk.as_dict() for dc, lk in self.links.items()},
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "threshold_tokens": self.threshold_tokens(),
        }

    def threshold_tokens(self) -> int:
        """The long-prompt threshold `auto` uses now: re-tuned, or the configured one."""
        return self.retuner.live_threshold() or self.cfg.inference_service.routing.long_context_threshold_tokens


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
    metrics = ServingMetrics("scheduler", "scheduler", cfg.topology.local_datacenter)
    tickets = TicketGate(cfg, "scheduler", metrics)  # signs only: reads the keys now, so missing ones stop start-up
    routing = cfg.inference_service.routing
    batch_queue = BatchQueue(routing.batch_queue_max, routing.batch_max_wait_s)
    metrics.registry.register(ClusterCollector(
        lambda: state.links, lambda: list(state.workers.values()),
        lambda: {"crossfill_batch_queue_depth": ("Batch requests waiting for spare capacity", len(batch_queue)),
                 "crossfill_routing_threshold_tokens": ("Long-prompt threshold auto routing uses now",
                                                        state.threshold_tokens())}))
    interval = cfg.serving.health_check_interval_ms / 1000
    tls = client_kwargs(cfg, "scheduler")  # mutual TLS to every worker; {} when off
    tracing = Tracing(cfg, "scheduler", "scheduler", cfg.topology.local_datacenter)

    async def poll_forever() -> None:
        # Generous: a busy worker (2 cores shared by everything) is slow, not dead.
        timeout = httpx.Timeout(max(interval * 4, 2.0))
        last_retune = time.monotonic()
        async with httpx.AsyncClient(timeout=timeout, trust_env=False, **tls) as client:
            while True:
                await state.probe_all(client)
                snap = state.snapshot()
                decode_ok = any(s.available for s in snap.instances if s.role == "decode")
                if decode_ok:
                    readiness.set_ready()
                else:
                    readiness.set_not_ready("no decode instance is healthy and ready")
                if batch_queue.retry():
                    log.info("batch queue: %d request(s) still waiting", len(batch_queue))
                if time.monotonic() - last_retune >= routing.retune_interval_s:
                    last_retune = time.monotonic()
                    plan = state.retuner.retune(snap, state.link_gbps())
                    if plan.get("status") == "ok":
                        log.info("retune: live threshold %s tokens (offload share %.2f, bottleneck %s)",
                                 plan["live"]["threshold_tokens"], plan["live"]["offload_share"],
                                 plan["live"]["bottleneck"])
                await asyncio.sleep(interval)

    async def probe_links_forever() -> None:
        every = cfg.inference_service.network.bandwidth_probe_interval_s
        # The payload of a slow link takes long: its own timeout, well beyond any link we serve.
        async with httpx.AsyncClient(timeout=httpx.Timeout(max(every * 10, 30.0)), trust_env=False, **tls) as client:
            while True:
                for dc in state.links:
                    await state.probe_bandwidth(client, dc)
                await asyncio.sleep(every)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(poll_forever())]
        if cfg.inference_service.network.bandwidth_probe_bytes and state.links:
            tasks.append(asyncio.create_task(probe_links_forever()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            tracing.shutdown()  # the last spans are written before the process exits

    app = FastAPI(title="crossfill scheduler", lifespan=lifespan)
    install_error_handlers(app)
    # /v1/admin/* takes an admin API key when security.auth is on; POST/DELETE are audited.
    app.add_middleware(AdminAuth, auth=Authenticator.from_config(cfg, open_audit(cfg, "scheduler")))
    add_health_routes(app, readiness)
    add_metrics_route(app, metrics, cfg.inference_service.observability.metrics_enabled)

    @app.post("/v1/route")
    async def route(request: Request) -> dict[str, object]:
        q = await parse_body(request, RouteQuery)
        span = tracing.start("scheduler.route", tracing.extract(request.headers), kind=SpanKind.SERVER, attributes={
            "crossfill.request_id": q.request_id, "crossfill.prompt_tokens": q.prompt_tokens,
            "crossfill.prefill_policy": q.prefill_policy, "crossfill.tenant_id": q.tenant_id})
        try:
            out = await decide_route(q, Tracing.context(span))
        except APIError as exc:
            end_span(span, error=exc.code or "error")
            raise
        except asyncio.CancelledError:  # the gateway hung up (a batch request waiting)
            end_span(span, error="cancelled")
            raise
        except Exception as exc:
            end_span(span, error=type(exc).__name__)
            raise
        end_span(span, {f"crossfill.route.{k}": out.get(k)
                        for k in ("kind", "prefill", "decode", "reason", "degradation_reason")})
        return out

    async def decide_route(q: RouteQuery, ctx: Context) -> dict[str, object]:
        if state.rounds == 0:
            raise APIError(503, "the scheduler is starting: no health probe round has answered yet",
                           code="not_ready", retry_after=cfg.serving.retry_after_s)
        req = state.route_request(q)

        def attempt() -> Route:
            return decide(req, avoiding(state.snapshot(), q.avoid_decode), cfg.inference_service)

        try:
            try:
                r = attempt()
            except Defer as deferred:
                log.info("route %s: batch request queued (%s)", q.request_id, deferred.message)

                def attempt_and_count() -> Route:
                    routed = attempt()
                    state.routed(q, routed)  # before the next waiter is tried
                    return routed

                queued = tracing.start("scheduler.batch_queue", ctx, attributes={"crossfill.reason": deferred.message})
                try:
                    r = await batch_queue.wait(routing.tenant(q.tenant_id).weight, attempt_and_count)
                finally:
                    end_span(queued)
            else:
                state.routed(q, r)
        except NoRoute as exc:
            retry = cfg.serving.retry_after_s if exc.status in (429, 503) else None
            metrics.errors.labels(exc.code).inc()
            metrics.sched.decisions.labels("refused", exc.code, "false").inc()
            param = {"invalid_prefill_policy": "prefill_policy", "invalid_request_type": "request_type"}.get(exc.code)
            raise APIError(exc.status, exc.message, code=exc.code, retry_after=retry, param=param) from None
        metrics.sched.decisions.labels(r.kind, reason_label(r.reason), str(bool(r.degradation_reason)).lower()).inc()
        if r.degradation_reason:
            metrics.fallbacks.labels("routing").inc()
            log.warning("request %s degraded at routing: %s", q.request_id, r.degradation_reason)
        log.info("route %s: %s prefill=%s decode=%s tenant=%s (%s)", q.request_id, r.kind, r.prefill, r.decode,
                 q.tenant_id or "", r.reason)
        out: dict[str, object] = dataclasses.asdict(r)
        endpoints = state.endpoints(r)
        if endpoints:
            out["endpoints"] = {n: e.model_dump() for n, e in endpoints.items()}
        ticket = tickets.sign(q.request_id, q.tenant_id, r)
        if ticket is not None:
            out["ticket"] = ticket  # the permission for this route's KV to move (security.tickets)
        return out

    @app.post("/v1/report/transfer")
    async def report(request: Request) -> dict[str, bool]:
        r = await parse_body(request, TransferReport)
        end_span(tracing.start("scheduler.transfer_report", tracing.extract(request.headers), kind=SpanKind.SERVER,
                               attributes={"crossfill.request_id": r.request_id, "crossfill.ok": r.ok,
                                           "crossfill.datacenter": r.from_datacenter,
                                           "crossfill.kv.wire_bytes": r.wire_bytes}))
        state.report_transfer(r)
        if r.from_datacenter in state.links:  # what crossed a link: its utilisation and retransmit rate
            m = metrics.sched
            m.link_transfers.labels(r.from_datacenter, "ok" if r.ok else "failed").inc()
            m.link_sent.labels(r.from_datacenter).inc(r.wire_bytes)
            m.link_frames.labels(r.from_datacenter).inc(r.frames)
            m.link_retransmitted.labels(r.from_datacenter).inc(r.retransmits)
        return {"ok": True}

    @app.post("/v1/admin/links/{datacenter}")
    async def set_link(datacenter: str, request: Request) -> dict[str, object]:
        body = await parse_body(request, LinkUpdate)
        link = state.links.get(datacenter)
        if link is None:
            raise APIError(404, f"no link from {datacenter!r} to {state.local}; links: {sorted(state.links)}",
                           param="datacenter", code="unknown_link")
        link.override_gbps = body.bandwidth_gbps
        log.warning("link %s: bandwidth %s by the admin API", datacenter,
                    "override cleared" if body.bandwidth_gbps is None else f"set to {body.bandwidth_gbps:g} Gbit/s")
        return link.as_dict()

    @app.get("/v1/admin/plan")
    async def plan() -> dict[str, object]:
        """The slow timescale: the last re-tuning, and a fresh one from the current picture."""
        fresh = state.retuner.retune(state.snapshot(), state.link_gbps())
        live = state.retuner.live_threshold()
        return {"live_threshold_tokens": state.threshold_tokens(),
                "threshold_source": "retuned" if live is not None else
                ("pinned (routing.pin_threshold)" if routing.pin_threshold else "configured (not re-tuned yet)"),
                "batch_waiting": len(batch_queue), **fresh}

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
