"""The prefill worker: runs prefill-only requests and ships each layer's KV to a decode instance.

`POST /v1/prefill` answers with an NDJSON stream of typed events (serving.protocol): `accepted`,
`alive` heartbeats while the request waits or computes (so decode can tell a busy prefill from a
dead one), `first_token` (with the queue/prefill timings) as soon as prefill ends, then `done` once
the transfer's commit is acknowledged (KV bytes, transfer stats), or `error` at any point. The KV
itself goes through the KV connector (`connector.PrefillConnector`, whatever `kv_cache.transport`
is) to the address decode gave, layer by layer as the engine computes it, so the transfer
overlaps prefill.

Reuse (M8.2): the job says how many leading prompt tokens decode already holds; when the claim
checks out, only the rest is exported and sent. Prefill computes only what its own prefix cache
lacks, and hands out cached KV from there.

Backpressure (M5.5): at most `prefill_pool.max_queue_depth` requests are queued or running; the
next one is refused with 429 and Retry-After at once instead of waiting in an unbounded queue.
If decode hangs up (it gave up, or its client left), the request is aborted in the engine and
the transfer is dropped, so nothing keeps computing or holding KV for nobody.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from opentelemetry.context import Context
from opentelemetry.trace import Span

from crossfill.config import CrossfillConfig, Instance
from crossfill.engine.types import LayerKVChunk, PrefillOutput
from crossfill.observability.request_log import RequestLog
from crossfill.observability.tracing import SpanKind, Tracing, end_span, perf_to_ns
from crossfill.security.audit import open_audit
from crossfill.serving.connector import PrefillConnector, build_manifest, kv_at_rest
from crossfill.serving.errors import parse_body
from crossfill.serving.protocol import (
    Accepted,
    Alive,
    ErrorEvent,
    FirstToken,
    KVReport,
    PrefillDone,
    PrefillJob,
    RouteInfo,
    ndjson,
)
from crossfill.serving.streaming import ClosingStreamingResponse, shielded
from crossfill.serving.transfer_tickets import TicketGate
from crossfill.serving.worker_common import WorkerBase

log = logging.getLogger("crossfill.prefill")
HEARTBEAT_S = 0.25


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, cfg: CrossfillConfig, inst: Instance, engine: Any | None = None) -> None:
        super().__init__(cfg, inst, engine, capacity=cfg.inference_service.prefill_pool.max_queue_depth)
        self.audit = open_audit(cfg, inst.name)  # one writer per file, or the hash chain forks
        self.connector = PrefillConnector(cfg, inst, kv_at_rest(cfg, registry=self.metrics.registry, audit=self.audit))
        self.tickets = TicketGate(cfg, inst.name, self.metrics, self.audit)
        self.request_log = RequestLog("prefill", inst.name)
        self.tracing = Tracing(cfg, "prefill", inst.name, inst.datacenter)
        # Decode runs in the local datacenter: this instance's KV crosses a link unless it is there too.
        self.route = "local" if inst.datacenter == cfg.topology.local_datacenter else "remote"
        # (tokens computed, seconds) of recent prefills: the speed the scheduler's routing and
        # re-tuning assume for this instance. A sum over several jobs, so long prompts (where
        # speed matters) weigh more than short ones (where fixed costs dominate).
        self._speed: deque[tuple[int, float]] = deque(maxlen=20)

    def prefill_tokens_per_s(self) -> float | None:
        tokens, seconds = sum(t for t, _ in self._speed), sum(s for _, s in self._speed)
        return tokens / seconds if tokens > 0 and seconds > 0 else None

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "transport": self.connector.transport,
                "prefill_tokens_per_s": self.prefill_tokens_per_s()}

    async def on_started(self) -> None:
        await self.connector.start()

    async def close(self) -> None:
        await self.connector.close()
        self.tracing.shutdown()  # the last spans are written before the process exits

    async def run(self, job: PrefillJob, trace_ctx: Context | None = None) -> AsyncIterator[bytes]:
        """Admit or refuse `job`, then stream its progress events; cleans up if the caller leaves.
        `trace_ctx`: decode's attempt span (from `traceparent`), the parent of this one."""
        arrived = time.perf_counter()
        span = self.tracing.start("prefill.request", trace_ctx, kind=SpanKind.SERVER, attributes={
            "crossfill.request_id": job.request_id, "crossfill.cache_id": job.cache_id,
            "crossfill.decode_instance": job.decode_instance, "crossfill.prompt_tokens": len(job.prompt_token_ids)},
            start_ns=perf_to_ns(arrived))  # the same clock reading as its queue span's start
        events: asyncio.Queue[FirstToken | PrefillDone | ErrorEvent] = asyncio.Queue()
        task = asyncio.create_task(self._prefill(job, arrived, events, Tracing.context(span)))
        finished = False
        error: str | None = "client_closed"  # the span's outcome unless an answer went out
        try:
            yield ndjson(Accepted(instance=self.inst.name, queue_depth=self.in_flight))
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), HEARTBEAT_S)
                except TimeoutError:
                    yield ndjson(Alive())
                    continue
                yield ndjson(ev)
                if isinstance(ev, PrefillDone | ErrorEvent):
                    finished = True
                    error = (ev.code or "error") if isinstance(ev, ErrorEvent) else None
                    return
        finally:
            if not finished:
                log.info("prefill %s: caller went away, aborting", job.request_id)
                task.cancel()
            await shielded(asyncio.wait([task]))  # not gather: a re-cancelled gather cuts the cleanup short
            if not task.cancelled():
                task.exception()  # retrieved: _prefill reports its own errors as events
            end_span(span, error=error)

    async def _prefill(self, job: PrefillJob, arrived: float,
                       events: asyncio.Queue[FirstToken | PrefillDone | ErrorEvent], ctx: Context) -> None:
        engine_id = job.cache_id  # unique per attempt, so a retry never collides with a stale one
        t_first: float | None = None
        out: PrefillOutput | None = None
        send: Span | None = None  # the transfer's span; its traceparent travels in the manifest
        failure = "cancelled"  # how `send` ends unless the commit is acknowledged
        try:
            plan = self.connector.plan(job)
            if plan.refused is not None:
                # A claim we cannot check costs bytes, never output: send everything, and say so.
                self.metrics.reuse_refused.labels(plan.refused.split(":", 1)[0]).inc()
                log.warning("prefill %s: decode's cached-prefix claim not used (%s); sending all KV",
                            job.request_id, plan.refused)
            manifest = build_manifest(self.cfg, cache_id=job.cache_id, request_id=job.request_id,
                                      tenant=job.tenant_id or "", fingerprint=self.engine.fingerprint,
                                      token_ids=job.prompt_token_ids, layer_specs=self.engine.layer_specs,
                                      skip_tokens=plan.export_from, ticket=job.ticket)
            send = self.tracing.start("kv.send", ctx, kind=SpanKind.PRODUCER, attributes={
                "crossfill.kv.transport": self.connector.transport, "crossfill.route": self.route,
                "crossfill.kv.export_from": plan.export_from})
            traceparent = Tracing.traceparent(send)
            if traceparent is not None:  # decode's import span joins the trace (kv/wire.py: optional field)
                manifest = dataclasses.replace(manifest, traceparent=traceparent)
            layers = max(len(self.engine.layer_specs), 1)
            async with self.connector.open(job, manifest) as tx:
                async for item in self.engine.prefill(engine_id, job.prompt_token_ids, job.sampling,
                                                      namespace=job.tenant_id or "", export_from=plan.export_from):
                    if isinstance(item, LayerKVChunk):
                        if t_first is None:
                            t_first = time.perf_counter()
                        await tx.send(item)
                    else:
                        out = item
                t_done = time.perf_counter()
                assert out is not None, "engine prefill ended without a PrefillOutput"
                # The first chunk appears after layer 0 of the first prompt chunk: estimate that
                # layer's time from the rest so queue and prefill split at the real compute start.
                first = t_first if t_first is not None else t_done
                per_layer = (t_done - first) / max(layers - 1, 1)
                start = max(arrived, first - per_layer)
                timings = {"queue": (start - arrived) * 1000, "prefill": (t_done - start) * 1000}
                self.tracing.record("prefill.queue", ctx, arrived, start)
                self.tracing.record("prefill.compute", ctx, start, t_done, {
                    "crossfill.prompt_tokens": len(job.prompt_token_ids),
                    "crossfill.cached_tokens": out.num_cached_tokens, "crossfill.kv.export_from": plan.export_from})
                result = {"first_token_id": out.first_token_id, "timings_ms": timings,
                          "num_cached_tokens": out.num_cached_tokens, "export_from": plan.export_from,
                          "reuse_refused": plan.refused}
                # The first token travels now, beside the last KV frames, not after the commit's
                # acknowledgement has come back: that saves decode a round trip on the WAN.
                await events.put(FirstToken(**result))
                stats = await tx.commit()
            end_span(send, {"crossfill.outcome": "ok", "crossfill.kv.raw_bytes": stats.raw_bytes,
                            "crossfill.kv.wire_bytes": stats.wire_bytes, "crossfill.kv.frames": stats.frames,
                            "crossfill.kv.retransmits": stats.retransmits, "crossfill.kv.reconnects": stats.reconnects})
            t_commit = time.perf_counter()
            timings["commit_wait"] = (t_commit - t_done) * 1000
            self.metrics.prefill.observe(t_done - start)
            self._observe(job, out, timings, stats.frames, stats.retransmits)
            self.metrics.worker.kv_reconnects.labels(self.route).inc(stats.reconnects)
            computed = len(job.prompt_token_ids) - out.num_cached_tokens
            if computed > 0 and t_done > start:
                self._speed.append((computed, t_done - start))
            self.request_log.emit("prefill", self._info(job, timings), status="ok",
                                  prompt_tokens=len(job.prompt_token_ids), prefill_cached_tokens=out.num_cached_tokens,
                                  sent_from_token=plan.export_from, kv_raw_bytes=stats.raw_bytes,
                                  kv_wire_bytes=stats.wire_bytes, kv_frames=stats.frames,
                                  kv_retransmits=stats.retransmits)
            await events.put(PrefillDone(**result, kv=KVReport.model_validate(stats.as_dict())))
        except asyncio.CancelledError:
            await self._abort_engine(engine_id)
            raise
        except ValueError as exc:
            failure = "invalid_request"
            self.request_log.emit("prefill", self._info(job, {}), status="error", error_code="invalid_request",
                                  error=str(exc))
            await events.put(ErrorEvent(status=400, code="invalid_request", message=str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported to decode, which retries or falls back
            failure = "prefill_failed"
            log.warning("prefill %s cache=%s failed: %s: %s", job.request_id, job.cache_id, type(exc).__name__, exc)
            self.request_log.emit("prefill", self._info(job, {}), status="error", error_code="prefill_failed",
                                  error=f"{type(exc).__name__}: {exc}")
            await self._abort_engine(engine_id)
            await events.put(ErrorEvent(status=502, code="prefill_failed",
                                        message=f"prefill on {self.inst.name} failed: {type(exc).__name__}: {exc}"))
        finally:
            if send is not None:  # nothing once the commit ended it
                end_span(send, {"crossfill.outcome": "error"}, error=failure)

    def _info(self, job: PrefillJob, timings: dict[str, float]) -> RouteInfo:
        """This prefill attempt as the request log reports it (decode's line covers the whole request)."""
        return RouteInfo(request_id=job.request_id, route=self.route, prefill_instance=self.inst.name,
                         decode_instance=job.decode_instance, cache_id=job.cache_id, timings_ms=timings,
                         trace_id=job.trace_id, tenant_id=job.tenant_id)

    def _observe(self, job: PrefillJob, out: PrefillOutput, timings: dict[str, float], frames: int,
                 retransmits: int) -> None:
        m = self.metrics.worker
        m.prefill_queue.observe(timings["queue"] / 1000)
        m.cache_hit.labels("prefill").inc(out.num_cached_tokens)
        m.cache_query.labels("prefill").inc(len(job.prompt_token_ids))
        m.frames_sent.labels(self.route).inc(frames)
        m.frames_retransmitted.labels(self.route).inc(retransmits)

    async def _abort_engine(self, engine_id: str) -> None:
        try:
            await shielded(self.engine.abort(engine_id))
        except Exception as exc:  # noqa: BLE001 - logged and counted; the request is over
            self.metrics.cleanup_failures.labels("engine_abort").inc()
            log.warning("prefill: aborting %s failed: %s", engine_id, exc)


def create_prefill_app(cfg: CrossfillConfig, inst: Instance, engine: Any | None = None) -> FastAPI:
    worker = PrefillWorker(cfg, inst, engine)
    app = worker.make_app("crossfill prefill")

    @app.post("/v1/prefill")
    async def prefill(request: Request) -> ClosingStreamingResponse:
        job = await parse_body(request, PrefillJob)
        worker.admit("prefill_queue_full",
                     f"prefill instance {inst.name} queue is full (max_queue_depth {worker.capacity})")
        # Before anything is computed or sent: the scheduler's ticket for exactly this job (403 otherwise).
        worker.tickets.check_prefill_job(job)
        return ClosingStreamingResponse(worker.run(job, worker.tracing.extract(request.headers)),
                                        media_type="application/x-ndjson")

    return app
