"""What prefill and decode workers share: engine start-up, readiness, admin and health routes.

The HTTP server starts before the model is loaded, so `/healthz` answers at once while `/readyz`
stays 503 ("loading model", then "warming up") until the engine has run its warm-up pass when
`prefill_pool.warmup_before_serving` asks for it; the scheduler routes only to ready instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from crossfill.config import CrossfillConfig, Instance
from crossfill.engine.kv_events import KVEventBatch
from crossfill.observability.collectors import EngineCollector
from crossfill.serving.errors import APIError, install_error_handlers
from crossfill.serving.health import Readiness, add_health_routes
from crossfill.serving.metrics import ServingMetrics, add_metrics_route

log = logging.getLogger("crossfill.worker")
PROBE_MAX_BYTES = 8 * 2**20  # `GET /v1/admin/probe?bytes=N`: the most one bandwidth probe fetches


class InFlight:
    """Requests a process holds now; `drained()` waits until there are none (graceful shutdown)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def drained(self) -> None:
        await self._idle.wait()


async def drain(readiness: Readiness, in_flight: InFlight, what: str) -> None:
    """Stop admitting (not ready: the scheduler stops routing, new calls get 503), let the rest finish."""
    readiness.drain()
    log.warning("%s draining: %d request(s) in flight, refusing new ones", what, in_flight.count)
    await in_flight.drained()
    log.warning("%s drained", what)


def release_when_request_ends(release: Callable[[], None]) -> None:
    """Run `release` once when the current request's task ends, however it ends.

    A streaming response whose client vanished before the body started never runs the body's
    `finally`; the request task always ends, so counters tied to it can never leak.
    """
    task = asyncio.current_task()
    assert task is not None
    task.add_done_callback(lambda _t: release())


class WorkerBase:
    role = "worker"

    def __init__(self, cfg: CrossfillConfig, inst: Instance, engine: Any | None = None, capacity: int = 1) -> None:
        self.cfg = cfg
        self.inst = inst
        self.engine = engine
        self.capacity = capacity  # requests this instance holds at once (queued or running)
        self.requests = InFlight()
        self.readiness = Readiness(self.role, inst.name)
        self.metrics = ServingMetrics(inst.name, inst.role, inst.datacenter)
        self.metrics.registry.register(EngineCollector(self.kv_stats))  # read at scrape time
        self._owns_engine = engine is None

    # -- engine lifecycle ---------------------------------------------------------------------
    def _load_engine(self) -> Any:
        from crossfill.engine.async_engine import AsyncEngine

        res = self.cfg.resources(self.inst.role)
        torch.set_num_threads(res.torch_threads)
        kwargs: dict[str, Any] = {"num_threads": res.torch_threads}
        if self.cfg.model.max_model_len is not None:
            kwargs["max_model_len"] = self.cfg.model.max_model_len
        max_seqs = self.cfg.model.max_num_seqs
        if self.inst.role == "decode":
            max_seqs = max(max_seqs, self.cfg.inference_service.decode_pool.max_concurrent_requests)
        return AsyncEngine.from_model(self.cfg.model.name, kv_memory_mb=res.kv_memory_mb,
                                      max_num_seqs=max_seqs, **kwargs)

    async def start(self) -> None:
        try:
            if self.engine is None:
                self.readiness.set_not_ready("loading model")
                self.engine = await asyncio.to_thread(self._load_engine)
            if self.cfg.inference_service.prefill_pool.warmup_before_serving:
                self.readiness.set_not_ready("warming up")
                await self.engine.warmup()
            await self.on_started()
            self.readiness.set_ready()
            log.info("%s %s ready on %s", self.role, self.inst.name, self.inst.url)
        except Exception as exc:  # noqa: BLE001 - stays alive but not ready, with the reason shown
            log.exception("%s %s failed to start", self.role, self.inst.name)
            self.readiness.set_not_ready(f"start-up failed: {type(exc).__name__}: {exc}")

    async def on_started(self) -> None:
        """Hook for role-specific start-up once the engine exists (decode opens its KV port)."""

    async def close(self) -> None:
        """Hook for role-specific shutdown."""

    def require_ready(self) -> None:
        if not self.readiness.ready:
            raise APIError(503, f"{self.role} instance {self.inst.name} is not ready: {self.readiness.reason}",
                           code="draining" if self.readiness.draining else "not_ready",
                           retry_after=self.cfg.serving.retry_after_s)

    def admit(self, code: str, refusal: str) -> None:
        """Count the current HTTP request against `capacity` until its task ends, or refuse it now.

        A refusal is a 429 with Retry-After (backpressure: the caller tries elsewhere or later),
        never a wait in an unbounded queue.
        """
        self.require_ready()
        if self.in_flight >= self.capacity:
            self.metrics.errors.labels(code).inc()
            raise APIError(429, refusal, code=code, retry_after=self.cfg.serving.retry_after_s)
        self.requests.enter()
        self.metrics.queue.set(self.in_flight)

        def release() -> None:
            self.requests.leave()
            self.metrics.queue.set(self.in_flight)

        release_when_request_ends(release)

    @property
    def in_flight(self) -> int:
        return self.requests.count

    async def drain(self) -> None:
        await drain(self.readiness, self.requests, f"{self.role} {self.inst.name}")

    def kv_stats(self) -> dict[str, int]:
        if self.engine is None:
            return {}
        return self.engine.kv_stats().as_dict()

    def stats(self) -> dict[str, Any]:
        return {"instance": self.inst.name, "role": self.role, "datacenter": self.inst.datacenter,
                "ready": self.readiness.ready, "reason": self.readiness.reason, "kv": self.kv_stats(),
                "queue_depth": self.in_flight, "capacity": self.capacity,
                "block_size": self.engine.block_size if self.engine is not None else None}

    def kv_events(self, since: int, epoch: str | None) -> dict[str, Any]:
        """Prefix-cache hash events for the scheduler's KV index (crossfill.engine.kv_events)."""
        if self.engine is None:  # still loading: nothing cached, and the next poll asks from scratch
            return KVEventBatch.nothing_yet().as_dict()
        return self.engine.kv_events_since(since, epoch).as_dict()

    def make_app(self, title: str) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            task = asyncio.create_task(self.start())
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await self.close()
                if self._owns_engine and self.engine is not None:
                    self.engine.shutdown()

        app = FastAPI(title=title, lifespan=lifespan)
        install_error_handlers(app)
        add_health_routes(app, self.readiness)
        add_metrics_route(app, self.metrics, self.cfg.inference_service.observability.metrics_enabled)

        @app.get("/v1/admin/kv")
        async def admin_kv() -> dict[str, Any]:
            if self.engine is None:
                raise APIError(503, "the engine is not loaded yet", code="not_ready")
            return {"instance": self.inst.name, **self.kv_stats()}

        @app.get("/v1/admin/stats")
        async def admin_stats(request: Request) -> JSONResponse:
            # ?kv_events_since=N[&kv_epoch=E] adds the prefix cache's hash events since N. A
            # JSONResponse, not a dict: FastAPI's encoder would walk a reset's 100k hashes one by one.
            body = self.stats()
            since = _int_param(request, "kv_events_since", None, None)
            if since is not None:
                body["kv_events"] = self.kv_events(since, request.query_params.get("kv_epoch"))
            return JSONResponse(body)

        @app.get("/v1/admin/probe")
        async def admin_probe(request: Request) -> Response:
            """N incompressible bytes: the scheduler times this fetch to measure the link's bandwidth."""
            n = _int_param(request, "bytes", 1, PROBE_MAX_BYTES)
            if n is None:
                raise APIError(400, f"'bytes' is required: how many bytes to send, 1 to {PROBE_MAX_BYTES}",
                               param="bytes", code="missing_field")
            data = _probe_payload()
            return Response(data if n == len(data) else data[:n], media_type="application/octet-stream",
                            headers={"Cache-Control": "no-store"})

        app.state.worker = self
        app.state.drain = self.drain
        return app


def _int_param(request: Request, name: str, lo: int | None, hi: int | None) -> int | None:
    """An integer query parameter (None when absent); a 400 naming it when it is not one in [lo, hi]."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f" in [{lo}, {hi}]" if lo is not None and hi is not None else ""
        raise APIError(400, f"'{name}' must be an integer{bounds}, got {raw!r}", param=name,
                       code="invalid_value")
    return value


@functools.cache
def _probe_payload() -> bytes:
    # Random, so no compression on the path makes the link look faster; made once per process,
    # then sliced, so a probe costs a copy and not a random-number generation.
    return os.urandom(PROBE_MAX_BYTES)
