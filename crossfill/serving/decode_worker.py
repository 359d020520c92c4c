"""The decode worker: admits a request, gets its KV from a prefill instance, decodes, streams tokens.

`POST /v1/decode` (from the gateway) answers an NDJSON stream of typed events (serving.protocol):
`routed` once the KV is verified and decoding starts (with the final route), `delta` per engine
step, then `done` or `error`. An error before `routed` is also reflected in the HTTP status, so
the gateway can answer a plain 4xx/5xx instead of a broken stream.

Getting the KV (attempts, retries, fallbacks) is `kv_fetch.KVFetcher`, over the KV connector
(`connector.DecodeConnector`, whatever `kv_cache.transport` is); the order of attempts is the
pure `policy.next_attempt`. This module is the HTTP surface and the decode loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from opentelemetry.context import Context

from crossfill.config import CrossfillConfig, Instance
from crossfill.observability.collectors import ReceiverCollector
from crossfill.observability.request_log import RequestLog
from crossfill.observability.tracing import SpanKind, Tracing, end_span
from crossfill.security.audit import open_audit
from crossfill.security.tls_http import client_kwargs
from crossfill.serving.connector import DecodeConnector, kv_at_rest
from crossfill.serving.errors import APIError, parse_body
from crossfill.serving.kv_fetch import KVFetcher
from crossfill.serving.protocol import DecodeJob, Delta, Done, ErrorEvent, Routed, RouteInfo, Usage, ndjson
from crossfill.serving.streaming import ClosingStreamingResponse, cancel_and_wait, shielded
from crossfill.serving.transfer_tickets import TicketGate
from crossfill.serving.worker_common import WorkerBase

log = logging.getLogger("crossfill.decode")


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, cfg: CrossfillConfig, inst: Instance, engine: Any | None = None) -> None:
        super().__init__(cfg, inst, engine, capacity=cfg.inference_service.decode_pool.max_concurrent_requests)
        self.audit = open_audit(cfg, inst.name)  # one writer per file, or the hash chain forks
        self.connector = DecodeConnector(cfg, inst, kv_at_rest(cfg, registry=self.metrics.registry, audit=self.audit))
        self.tickets = TicketGate(cfg, inst.name, self.metrics, self.audit)
        self.metrics.registry.register(ReceiverCollector(self.connector.counters))  # refusals, checksum failures
        self.request_log = RequestLog("decode", inst.name)
        self.tracing = Tracing(cfg, "decode", inst.name, inst.datacenter)
        self.fetcher: KVFetcher | None = None
        self._background: set[asyncio.Task[Any]] = set()  # every task we start, so none is lost
        self.http: httpx.AsyncClient | None = None
        self.instances = {i.name: i for i in cfg.instances()}
        self._tls = client_kwargs(cfg, inst.name)  # mutual TLS to prefill and the scheduler; {} when off
        self.active: dict[str, asyncio.Task[Any]] = {}  # request id -> the HTTP request task serving it

    def supersede(self, request_id: str) -> None:
        """At most one live execution per request id: a retry of an id still running here cancels
        the older one (its caller gave up on it before retrying), which aborts it and frees its KV."""
        task = asyncio.current_task()
        assert task is not None
        old = self.active.get(request_id)
        if old is not None and not old.done():
            log.warning("decode %s: a retry supersedes the attempt still running here; cancelling it", request_id)
            old.cancel()
        self.active[request_id] = task

        def forget(t: asyncio.Task[Any]) -> None:
            if self.active.get(request_id) is t:
                del self.active[request_id]

        task.add_done_callback(forget)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "transport": self.connector.transport, "transfers": self.connector.counters()}

    async def on_started(self) -> None:
        await self.connector.start()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False, **self._tls)
        self.fetcher = KVFetcher(self.cfg, self.inst, self.engine, self.connector, self.http, self.metrics,
                                 self._report, self._background, tickets=self.tickets, tracing=self.tracing)

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.connector.close()
        if self.http is not None:
            await self.http.aclose()
        self.tracing.shutdown()  # the last spans are written before the process exits

    # -- one request ----------------------------------------------------------------------------
    async def run(self, job: DecodeJob, first: asyncio.Future[tuple[int, ErrorEvent | None]],
                  trace_ctx: Context | None = None) -> AsyncIterator[bytes]:
        """Serve `job`; resolves `first` with (status, error or None) before streaming anything else.
        `trace_ctx`: the gateway's request span (from `traceparent`), the parent of this one."""
        started = time.perf_counter()
        span = self.tracing.start("decode.request", trace_ctx, kind=SpanKind.SERVER, attributes={
            "crossfill.request_id": job.request_id, "crossfill.tenant_id": job.tenant_id,
            "crossfill.prompt_tokens": len(job.prompt_token_ids), "crossfill.route_reason": job.route.reason})
        ctx = Tracing.context(span)
        error: str | None = "client_closed"  # the span's outcome unless an answer went out
        completion_tokens = 0
        info = RouteInfo(request_id=job.request_id, route=job.route.kind, prefill_instance=job.route.prefill,
                         decode_instance=self.inst.name, degradation_reason=job.route.degradation_reason,
                         route_reason=job.route.reason, request_type=job.route.request_type,
                         trace_id=job.trace_id, tenant_id=job.tenant_id)
        finished = False  # an answer (result or error) went out
        engine_done = False  # the engine finished the request itself (nothing to abort)
        engine_id: str | None = None
        params = job.sampling
        try:
            if job.route.prefill == self.inst.name:
                # Colocated: this instance prefills itself (mode colocated).
                engine_id = f"{job.request_id}.local"
                stream = self.engine.generate(engine_id, job.prompt_token_ids, params,
                                              namespace=job.tenant_id or "")
                t_kv = time.perf_counter()
            else:
                assert self.fetcher is not None
                try:
                    async with asyncio.timeout(job.deadline_s):
                        got = await self.fetcher.fetch(job, params, info, started, ctx)
                except TimeoutError:
                    raise APIError(504, f"no KV cache for {job.request_id} within the request deadline "
                                   f"({job.deadline_s:g}s)", code="deadline_exceeded") from None
                engine_id = got.reservation.cache_id
                where = self.fetcher.instance(got.prefill, job).datacenter
                info.route = "remote" if where != self.inst.datacenter else "local"
                info.prefill_instance, info.cache_id = got.prefill, engine_id
                info.transport = self.connector.transport
                info.kv_raw_bytes, info.kv_wire_bytes = got.raw_bytes, got.wire_bytes
                info.decode_cached_tokens, info.prefill_cached_tokens = got.decode_cached_tokens, got.prefill_cached_tokens
                info.kv_wire_bytes_saved = got.wire_bytes_saved
                if got.notes:
                    info.degradation_reason = "; ".join(r for r in (info.degradation_reason, *got.notes) if r)
                info.timings_ms.update(got.timings)
                self.metrics.worker.cache_hit.labels("decode").inc(got.decode_cached_tokens)
                self.metrics.worker.cache_query.labels("decode").inc(len(job.prompt_token_ids))
                t_kv = time.perf_counter()
                stream = got.reservation.handle.decode(got.first_token_id)
            first_out = True
            t_first = t_kv
            async for out in stream:
                if first_out:
                    t_first = time.perf_counter()
                    info.timings_ms["first_decode"] = (t_first - t_kv) * 1000
                    # From verified KV (colocated: from the start, prefill included) to the first token out.
                    self.tracing.record("decode.first_token", ctx, t_kv, t_first,
                                        {"crossfill.colocated": job.route.prefill == self.inst.name})
                    if not first.done():
                        first.set_result((200, None))
                        yield ndjson(Routed(crossfill=info))
                    first_out = False
                if out.error:
                    raise APIError(500, f"engine error: {out.error}", code="engine_error")
                if time.perf_counter() - started > job.deadline_s:
                    raise APIError(504, f"request deadline ({job.deadline_s:g}s, serving.request_timeout_s) "
                                   "passed while decoding", code="deadline_exceeded")
                if out.new_token_ids or out.new_text:
                    self.metrics.tokens.inc(len(out.new_token_ids))
                    yield ndjson(Delta(token_ids=out.new_token_ids, text=out.new_text))
                if out.finished:
                    finished = engine_done = True
                    error, completion_tokens = None, out.completion_tokens
                    self.tracing.record("decode.generate", ctx, t_first, time.perf_counter(),
                                        {"crossfill.completion_tokens": out.completion_tokens,
                                         "crossfill.finish_reason": out.finish_reason})
                    info.timings_ms["decode"] = (time.perf_counter() - t_first) * 1000
                    info.timings_ms["decode_total"] = (time.perf_counter() - started) * 1000
                    self.metrics.requests.labels(info.route, "ok").inc()
                    self._observe_decode(job, info, out.completion_tokens, out.num_cached_tokens)
                    self.request_log.emit("decode", info, status="ok", finish_reason=out.finish_reason,
                                          prompt_tokens=len(job.prompt_token_ids),
                                          output_tokens=out.completion_tokens,
                                          kv_raw_bytes=info.kv_raw_bytes, kv_wire_bytes=info.kv_wire_bytes)
                    yield ndjson(Done(finish_reason=out.finish_reason, crossfill=info,
                                      usage=Usage(prompt_tokens=len(job.prompt_token_ids),
                                                  completion_tokens=out.completion_tokens,
                                                  cached_tokens=out.num_cached_tokens)))
                    return
            raise APIError(500, "engine stream ended without a final output", code="engine_error")
        except APIError as exc:
            finished = True
            error = exc.code or "error"
            self.metrics.errors.labels(exc.code or "error").inc()
            self.metrics.requests.labels(info.route, "error").inc()
            self.request_log.emit("decode", info, status="error", error_code=exc.code or "error",
                                  error=f"{exc.status} {exc.message}")
            ev = ErrorEvent(status=exc.status, code=exc.code, message=exc.message, retry_after=exc.retry_after,
                            crossfill=info)
            if not first.done():
                first.set_result((exc.status, ev))
            yield ndjson(ev)
        except ValueError as exc:  # the engine's limits (prompt or max_tokens past the context)
            finished = True
            error = "context_length_exceeded"
            self.metrics.requests.labels(info.route, "error").inc()
            self.request_log.emit("decode", info, status="error", error_code="context_length_exceeded", error=str(exc))
            ev = ErrorEvent(status=400, code="context_length_exceeded", message=str(exc), param="max_tokens",
                            crossfill=info)
            if not first.done():
                first.set_result((400, ev))
            yield ndjson(ev)
        finally:
            if not finished:
                log.info("decode %s: client went away, aborting", job.request_id)
                self.request_log.emit("decode", info, status="client_closed", error_code="client_closed")
            if engine_id is not None and not engine_done:
                try:
                    await shielded(self.engine.abort(engine_id))
                except Exception as exc:  # noqa: BLE001 - logged and counted; the request is over
                    self.metrics.cleanup_failures.labels("engine_abort").inc()
                    log.warning("decode %s: aborting %s failed: %s", job.request_id, engine_id, exc)
            if not first.done():
                first.set_result((499, ErrorEvent(status=499, code="client_closed", message="client closed the request")))
            end_span(span, {"crossfill.route": info.route, "crossfill.prefill_instance": info.prefill_instance,
                            "crossfill.cache_id": info.cache_id, "crossfill.retries": info.retries,
                            "crossfill.kv.raw_bytes": info.kv_raw_bytes, "crossfill.kv.wire_bytes": info.kv_wire_bytes,
                            "crossfill.completion_tokens": completion_tokens}, error=error)

    def _observe_decode(self, job: DecodeJob, info: RouteInfo, completion_tokens: int, cached_tokens: int) -> None:
        decode_s = info.timings_ms.get("decode", 0.0) / 1000
        self.metrics.worker.decode_seconds.labels(info.route).observe(decode_s)
        if decode_s > 0 and completion_tokens > 1:
            # The first token came from prefill: the decode loop made the others.
            self.metrics.worker.decode_tps.labels(info.route).observe((completion_tokens - 1) / decode_s)
        if job.route.prefill == self.inst.name:  # colocated: this instance's own prefix cache served the prompt
            self.metrics.worker.cache_hit.labels("decode").inc(cached_tokens)
            self.metrics.worker.cache_query.labels("decode").inc(len(job.prompt_token_ids))

    def kv_stats(self) -> dict[str, int]:
        stats = super().kv_stats()
        self.metrics.preemptions.set(stats.get("preemptions", 0))
        return stats

    def _report(self, prefill: str, wire_bytes: int, seconds: float, ok: bool, tail_seconds: float = 0.0, *,
                request_id: str | None = None, tokens: int = 0, frames: int = 0, retransmits: int = 0,
                trace_headers: dict[str, str] | None = None) -> None:
        """Tell the scheduler what a cross-DC transfer cost (link estimates, breaker, in-flight); best effort."""
        inst = self.instances.get(prefill)
        if inst is None or inst.datacenter == self.inst.datacenter or self.http is None:
            return
        url = self.cfg.scheduler_url() + "/v1/report/transfer"
        body = {"from_datacenter": inst.datacenter, "wire_bytes": wire_bytes, "seconds": seconds,
                "tail_seconds": tail_seconds, "ok": ok, "request_id": request_id, "tokens": max(tokens, 0),
                "frames": frames, "retransmits": retransmits}

        async def send() -> None:
            assert self.http is not None
            try:
                await self.http.post(url, json=body, timeout=2.0, headers=trace_headers)
            except httpx.HTTPError as exc:  # the scheduler may be restarting: a missed sample, no more
                log.debug("transfer report to the scheduler failed: %s", exc)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def create_decode_app(cfg: CrossfillConfig, inst: Instance, engine: Any | None = None) -> FastAPI:
    worker = DecodeWorker(cfg, inst, engine)
    app = worker.make_app("crossfill decode")

    @app.post("/v1/decode", response_model=None)
    async def decode(request: Request) -> ClosingStreamingResponse | JSONResponse:
        job = await parse_body(request, DecodeJob)
        worker.admit("decode_full", f"decode instance {inst.name} is at max_concurrent_requests ({worker.capacity})")
        worker.supersede(job.request_id)
        first: asyncio.Future[tuple[int, ErrorEvent | None]] = asyncio.get_running_loop().create_future()
        gen = worker.run(job, first, worker.tracing.extract(request.headers))
        # Drive the stream until its first event, so errors before decoding get a real HTTP status;
        # meanwhile watch the caller, so a gateway that hangs up during prefill/transfer aborts it.
        step = asyncio.ensure_future(anext(gen))
        while not step.done():
            await asyncio.wait({step}, timeout=0.1)
            if not step.done() and await request.is_disconnected():
                await cancel_and_wait(step)
                await gen.aclose()
                return JSONResponse({"error": {"message": "caller went away", "type": "client_closed",
                                               "param": None, "code": "client_closed"}}, status_code=499)
        first_chunk = step.result()
        status, err = first.result() if first.done() else (200, None)
        if status != 200 and err is not None:
            await gen.aclose()
            return JSONResponse({"error": {"message": err.message, "type": "decode_error", "param": err.param,
                                           "code": err.code},
                                 "crossfill": err.crossfill.as_dict() if err.crossfill else None},
                                status_code=status,
                                headers={"Retry-After": str(err.retry_after)} if err.retry_after else None)

        async def body() -> AsyncIterator[bytes]:
            try:
                yield first_chunk
                async for chunk in gen:
                    yield chunk
            finally:  # the gateway hung up: close the run, which aborts the engine request
                await shielded(gen.aclose())

        return ClosingStreamingResponse(body(), media_type="application/x-ndjson")

    return app
