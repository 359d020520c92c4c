"""The decode worker: admits a request, gets its KV from a prefill instance, decodes, streams tokens.

`POST /v1/decode` (from the gateway) answers an NDJSON stream: `routed` once the KV is verified
and decoding starts (with the final route), `delta` per engine step, then `done` or `error`. An
error before `routed` is also reflected in the HTTP status, so the gateway can answer a plain
4xx/5xx instead of a broken stream.

Per attempt (M5.8): allocate the request's KV blocks first (`import_kv`; a full decode refuses
with 503 before any transfer starts), expect a fresh cache id on the KV port, ask the prefill
instance to compute and send, and wait for both the prefill's answer and the verified commit.
Every wait has a deadline: silence from prefill longer than `kv_cache.timeout_ms`, or the
transfer's own timeouts, end the attempt; its blocks are freed and it is retried up to
`kv_cache.max_retry` times on that instance, then on the route's fallbacks (other remote pools,
then local prefill when `fallback_to_local_on_failure`), then the request fails explicitly.
A fallback is recorded in the route info, a log line and the `crossfill_fallbacks` counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from crossfill.config import CrossfillConfig, Instance
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import NoKVCapacityError
from crossfill.kv.errors import TransferError
from crossfill.kv.tcp import KVReceiver
from crossfill.kv.wire import token_digest
from crossfill.serving.errors import APIError, parse_body
from crossfill.serving.kvlink import import_namespace, make_receiver
from crossfill.serving.protocol import DecodeJob, PrefillJob, RouteInfo, ndjson
from crossfill.serving.worker_common import WorkerBase, release_when_request_ends

log = logging.getLogger("crossfill.decode")


class AttemptFailed(Exception):
    def __init__(self, reason: str, retryable: bool = True, status: int = 502) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.status = status


@dataclass
class _Prefilled:
    handle: Any  # KVImportHandle with verified KV
    first_token_id: int
    cache_id: str
    prefill: str
    timings: dict[str, float]
    raw_bytes: int
    wire_bytes: int


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, cfg: CrossfillConfig, inst: Instance, engine: Any | None = None) -> None:
        super().__init__(cfg, inst, engine)
        self.capacity = cfg.inference_service.decode_pool.max_concurrent_requests
        self.active = 0
        self.receiver: KVReceiver | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.http: httpx.AsyncClient | None = None
        self.instances = {i.name: i for i in cfg.instances()}

    def stats(self) -> dict[str, Any]:
        out = {**super().stats(), "queue_depth": self.active, "capacity": self.capacity}
        if self.receiver is not None:
            out["transfers"] = self.receiver.counters()
        return out

    async def on_started(self) -> None:
        assert self.inst.kv_port is not None
        self.receiver = await make_receiver(self.cfg, self.inst.host, self.inst.kv_port).start()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False)

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        if self.receiver is not None:
            await self.receiver.close()
        if self.http is not None:
            await self.http.aclose()

    # -- one request ----------------------------------------------------------------------------
    async def run(self, job: DecodeJob, first: asyncio.Future[tuple[int, dict[str, Any]]]) -> AsyncIterator[bytes]:
        """Serve `job`; resolves `first` with (status, first event) before streaming anything else."""
        started = time.perf_counter()
        info = RouteInfo(request_id=job.request_id, route=job.route.kind, prefill_instance=job.route.prefill,
                         decode_instance=self.inst.name, degradation_reason=job.route.degradation_reason,
                         trace_id=job.trace_id, tenant_id=job.tenant_id)
        handle: Any = None
        finished = False  # an answer (result or error) went out
        engine_done = False  # the engine finished the request itself (nothing to abort)
        engine_id: str | None = None
        try:
            try:
                params = SamplingParams(**job.sampling.model_dump())
            except ValueError as exc:
                raise APIError(400, str(exc), code="invalid_sampling") from None
            if job.route.prefill == self.inst.name:
                # Colocated: this instance prefills itself (mode colocated).
                engine_id = f"{job.request_id}.local"
                stream = self.engine.generate(engine_id, job.prompt_token_ids, params,
                                              namespace=job.tenant_id or "")
                t_kv = time.perf_counter()
            else:
                try:
                    async with asyncio.timeout(job.deadline_s):
                        got = await self._get_kv(job, params, info, started)
                except TimeoutError:
                    raise APIError(504, f"no KV cache for {job.request_id} within the request deadline "
                                   f"({job.deadline_s:g}s)", code="deadline_exceeded") from None
                handle, engine_id = got.handle, got.cache_id
                info.route = "remote" if self.instances[got.prefill].datacenter != self.inst.datacenter else "local"
                info.prefill_instance, info.cache_id = got.prefill, got.cache_id
                info.kv_raw_bytes, info.kv_wire_bytes = got.raw_bytes, got.wire_bytes
                info.timings_ms.update(got.timings)
                t_kv = time.perf_counter()
                stream = handle.decode(got.first_token_id)
            first_out = True
            t_first = t_kv
            async for out in stream:
                if first_out:
                    t_first = time.perf_counter()
                    info.timings_ms["first_decode"] = (t_first - t_kv) * 1000
                    if not first.done():
                        first.set_result((200, {"event": "routed", "crossfill": info.as_dict()}))
                        yield ndjson({"event": "routed", "crossfill": info.as_dict()})
                    first_out = False
                if out.error:
                    raise APIError(500, f"engine error: {out.error}", code="engine_error")
                if time.perf_counter() - started > job.deadline_s:
                    raise APIError(504, f"request deadline ({job.deadline_s:g}s, serving.request_timeout_s) "
                                   "passed while decoding", code="deadline_exceeded")
                if out.new_token_ids or out.new_text:
                    self.metrics.tokens.inc(len(out.new_token_ids))
                    yield ndjson({"event": "delta", "token_ids": out.new_token_ids, "text": out.new_text})
                if out.finished:
                    finished = engine_done = True
                    info.timings_ms["decode"] = (time.perf_counter() - t_first) * 1000
                    info.timings_ms["decode_total"] = (time.perf_counter() - started) * 1000
                    self.metrics.requests.labels(info.route, "ok").inc()
                    yield ndjson({"event": "done", "finish_reason": out.finish_reason,
                                  "usage": {"prompt_tokens": len(job.prompt_token_ids),
                                            "completion_tokens": out.completion_tokens,
                                            "cached_tokens": out.num_cached_tokens},
                                  "crossfill": info.as_dict()})
                    return
            raise APIError(500, "engine stream ended without a final output", code="engine_error")
        except APIError as exc:
            finished = True
            self.metrics.errors.labels(exc.code or "error").inc()
            ev = {"event": "error", "status": exc.status, "code": exc.code, "message": exc.message,
                  "retry_after": exc.retry_after, "crossfill": info.as_dict()}
            if not first.done():
                first.set_result((exc.status, ev))
            yield ndjson(ev)
        except ValueError as exc:  # the engine's limits (prompt or max_tokens past the context)
            finished = True
            ev = {"event": "error", "status": 400, "code": "context_length_exceeded", "message": str(exc),
                  "param": "max_tokens", "crossfill": info.as_dict()}
            if not first.done():
                first.set_result((400, ev))
            yield ndjson(ev)
        finally:
            if not finished:
                log.info("decode %s: client went away, aborting", job.request_id)
            if engine_id is not None and not engine_done:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.engine.abort(engine_id))
            if not first.done():
                first.set_result((499, {"event": "error", "status": 499, "code": "client_closed",
                                        "message": "client closed the request"}))

    async def _get_kv(self, job: DecodeJob, params: SamplingParams, info: RouteInfo, started: float) -> _Prefilled:
        kv = self.cfg.inference_service.kv_cache
        candidates = [job.route.prefill, *job.route.fallbacks]
        failures: list[str] = []
        statuses: list[int] = []
        for idx, name in enumerate(candidates):
            if name not in self.instances or self.instances[name].role != "prefill":
                failures.append(f"{name}: not a prefill instance")
                continue
            for _attempt in range(1 + kv.max_retry):
                try:
                    got = await self._attempt(job, params, name, started)
                except AttemptFailed as exc:
                    failures.append(f"{name}: {exc.reason}")
                    statuses.append(exc.status)
                    info.retries += 1
                    self.metrics.retries.inc()
                    log.warning("decode %s: KV from %s failed (%s)", job.request_id, name, exc.reason)
                    self._report(name, 0, 0.0, ok=False)
                    if not exc.retryable:
                        break
                    continue
                info.retries = len(failures)
                if failures:
                    where = "local" if self.instances[name].datacenter == self.inst.datacenter else "remote"
                    reason = f"{failures[-1]}; served by {where} prefill {name} after {len(failures)} failed attempt(s)"
                    if idx > 0:
                        reason = (f"prefill {candidates[0]} failed ({failures[-1]}); fell back to {where} prefill "
                                  f"{name}")
                        self.metrics.fallbacks.labels("prefill_failed").inc()
                        log.warning("decode %s: FALLBACK %s", job.request_id, reason)
                    info.degradation_reason = "; ".join(r for r in (info.degradation_reason, reason) if r)
                return got
        if statuses and all(st == 429 for st in statuses):
            # Every prefill refused for a full queue: backpressure, not a failure. Say when to retry.
            self.metrics.errors.labels("prefill_queue_full").inc()
            raise APIError(429, "every prefill instance on the route has a full queue: " + "; ".join(failures),
                           code="prefill_queue_full", retry_after=self.cfg.serving.retry_after_s)
        self.metrics.errors.labels("kv_transfer_failed").inc()
        policy_note = ("" if self.cfg.inference_service.routing.fallback_to_local_on_failure
                       else " (fallback_to_local_on_failure is false)")
        raise APIError(502, f"could not get the KV cache for {job.request_id} after {len(failures)} attempt(s)"
                       f"{policy_note}: " + "; ".join(failures[-4:]), code="kv_transfer_failed")

    async def _attempt(self, job: DecodeJob, params: SamplingParams, name: str, started: float) -> _Prefilled:
        assert self.receiver is not None and self.http is not None
        kv = self.cfg.inference_service.kv_cache
        timeout_s = kv.timeout_ms / 1000
        cache_id = f"{job.request_id}.{uuid.uuid4().hex[:12]}"
        try:
            handle = await self.engine.import_kv(cache_id, job.prompt_token_ids, params,
                                                 namespace=import_namespace(self.cfg, job.tenant_id or ""))
        except NoKVCapacityError as exc:
            raise APIError(503, f"decode instance {self.inst.name} has no free KV blocks: {exc}",
                           code="decode_kv_full", retry_after=self.cfg.serving.retry_after_s) from None
        ok = False
        try:
            checks: dict[str, Any] = {}
            if kv.checksum_enabled:
                checks = {"fingerprint": self.engine.fingerprint, "token_digest": token_digest(job.prompt_token_ids)}
            self.receiver.expect(cache_id, handle.write, tenant=job.tenant_id or "", timeout_ms=kv.timeout_ms, **checks)
            prefill_inst = self.instances[name]
            kv_host, kv_port = self.cfg.kv_address(self.inst.name, prefill_inst.datacenter)
            pjob = PrefillJob(request_id=job.request_id, cache_id=cache_id, prompt_token_ids=job.prompt_token_ids,
                              sampling=job.sampling, kv_host=kv_host, kv_port=kv_port,
                              decode_instance=self.inst.name, tenant_id=job.tenant_id, trace_id=job.trace_id)
            t_call = time.perf_counter()
            t_kv: list[float] = []

            async def wait_kv() -> Any:
                assert self.receiver is not None
                manifest = await self.receiver.wait(cache_id)
                t_kv.append(time.perf_counter())  # when the commit verified, not when we noticed
                return manifest

            kv_task = asyncio.create_task(wait_kv())
            first_fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            pre_task = asyncio.create_task(self._call_prefill(name, pjob, timeout_s, first_fut))
            got_both = False
            try:
                # Done when the KV is verified and the first token is known; the prefill's stream
                # then runs on to its `done` event in the background (transfer stats).
                while not (kv_task.done() and first_fut.done()):
                    waits: set[asyncio.Future[Any]] = set()
                    if not kv_task.done():
                        waits.add(kv_task)
                    if not first_fut.done():
                        waits |= {first_fut, pre_task}
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if kv_task.done():
                        kv_task.result()  # raises TransferError
                    if pre_task.done() and not first_fut.done():
                        pre_task.result()  # raises AttemptFailed
                        raise AttemptFailed("prefill stream ended without a first token")
                got_both = True
            except TransferError as exc:
                raise AttemptFailed(f"KV transfer failed: {exc}") from None
            finally:
                if not got_both:
                    for t in (kv_task, pre_task):
                        if not t.done():
                            t.cancel()
                    await asyncio.gather(kv_task, pre_task, return_exceptions=True)
            first_ev = first_fut.result()
            t_kv_done = t_kv[0]
            raw, wire = self.receiver.transfer_bytes(cache_id)
            p_timings = first_ev.get("timings_ms", {})
            queue_ms = (t_call - started) * 1000 + p_timings.get("queue", 0.0)
            prefill_ms = p_timings.get("prefill", 0.0)
            transfer_ms = max((t_kv_done - started) * 1000 - queue_ms - prefill_ms, 0.0)
            self._finish_in_background(pre_task, name, wire)
            self.metrics.transfer.observe(transfer_ms / 1000)
            self.metrics.kv_raw.inc(raw)
            self.metrics.kv_wire.inc(wire)
            ok = True
            return _Prefilled(handle, int(first_ev["first_token_id"]), cache_id, name,
                              {"queue": queue_ms, "prefill": prefill_ms, "transfer": transfer_ms}, raw, wire)
        finally:
            if not ok:
                self.receiver.cancel(cache_id, "attempt abandoned by decode")
                with contextlib.suppress(Exception):
                    await asyncio.shield(handle.abort())

    def _finish_in_background(self, pre_task: asyncio.Task[dict[str, Any]], name: str, wire: int) -> None:
        """Let the prefill stream reach `done`, then report the transfer to the scheduler."""
        self._background.add(pre_task)

        def done(t: asyncio.Task[dict[str, Any]]) -> None:
            self._background.discard(t)
            if t.cancelled() or t.exception() is not None:
                return
            kv_stats = t.result().get("kv", {})
            self._report(name, int(kv_stats.get("wire_bytes", wire)), float(kv_stats.get("duration_s", 0.0)),
                         ok=True, tail_seconds=float(kv_stats.get("commit_wait_s", 0.0)))

        pre_task.add_done_callback(done)

    async def _call_prefill(self, name: str, pjob: PrefillJob, timeout_s: float,
                            first: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
        """POST the prefill job and follow its event stream to `done`, resolving `first` on `first_token`.

        Silence beyond timeout_s (prefill sends heartbeats) fails the attempt.
        """
        assert self.http is not None
        url = self.cfg.http_url(name) + "/v1/prefill"
        try:
            async with self.http.stream("POST", url, json=pjob.model_dump(),
                                        timeout=httpx.Timeout(timeout_s, connect=timeout_s)) as resp:
                if resp.status_code != 200:
                    body = await resp.aread()
                    try:
                        msg = json.loads(body)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        msg = body[:200].decode(errors="replace")
                    # A full or unready instance will not take it on retry either: move on.
                    raise AttemptFailed(f"prefill answered HTTP {resp.status_code}: {msg}",
                                        retryable=resp.status_code >= 500 and resp.status_code != 503,
                                        status=resp.status_code)
                lines = resp.aiter_lines()
                while True:
                    try:
                        line = await asyncio.wait_for(anext(lines), timeout_s)
                    except StopAsyncIteration:
                        raise AttemptFailed("prefill stream ended without a result") from None
                    except TimeoutError:
                        raise AttemptFailed(f"no word from prefill for kv_cache.timeout_ms "
                                            f"({int(timeout_s * 1000)} ms)") from None
                    if not line:
                        continue
                    ev = json.loads(line)
                    if ev.get("event") == "first_token" and not first.done():
                        first.set_result(ev)
                    if ev.get("event") == "done":
                        if not first.done():
                            first.set_result(ev)
                        return ev
                    if ev.get("event") == "error":
                        raise AttemptFailed(f"prefill error: {ev.get('message')}", retryable=ev.get("status", 502) >= 500)
        except httpx.HTTPError as exc:
            raise AttemptFailed(f"prefill {name} unreachable: {type(exc).__name__}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise AttemptFailed(f"prefill sent a malformed event: {exc}") from None

    def _report(self, prefill: str, wire_bytes: int, seconds: float, ok: bool, tail_seconds: float = 0.0) -> None:
        """Tell the scheduler what a cross-DC transfer cost (its bandwidth estimate); best effort."""
        inst = self.instances.get(prefill)
        if inst is None or inst.datacenter == self.inst.datacenter or self.http is None:
            return
        url = f"http://{self.cfg.topology.scheduler.host}:{self.cfg.topology.scheduler.port}/v1/report/transfer"
        body = {"from_datacenter": inst.datacenter, "wire_bytes": wire_bytes, "seconds": seconds,
                "tail_seconds": tail_seconds, "ok": ok}

        async def send() -> None:
            with contextlib.suppress(Exception):
                await self.http.post(url, json=body, timeout=2.0)  # type: ignore[union-attr]

        asyncio.get_running_loop().create_task(send())


def create_decode_app(cfg: CrossfillConfig, inst: Instance, engine: Any | None = None) -> FastAPI:
    worker = DecodeWorker(cfg, inst, engine)
    app = worker.make_app("crossfill decode")

    @app.post("/v1/decode", response_model=None)
    async def decode(request: Request) -> StreamingResponse | JSONResponse:
        job = await parse_body(request, DecodeJob)
        worker.require_ready()
        if worker.active >= worker.capacity:
            worker.metrics.errors.labels("decode_full").inc()
            raise APIError(429, f"decode instance {inst.name} is at max_concurrent_requests ({worker.capacity})",
                           code="decode_full", retry_after=cfg.serving.retry_after_s)
        worker.active += 1
        worker.metrics.queue.set(worker.active)

        def release() -> None:
            worker.active -= 1
            worker.metrics.queue.set(worker.active)

        release_when_request_ends(release)
        first: asyncio.Future[tuple[int, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        gen = worker.run(job, first)
        # Drive the stream until its first event, so errors before decoding get a real HTTP status;
        # meanwhile watch the caller, so a gateway that hangs up during prefill/transfer aborts it.
        step = asyncio.ensure_future(anext(gen))
        while not step.done():
            await asyncio.wait({step}, timeout=0.1)
            if not step.done() and await request.is_disconnected():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                await gen.aclose()
                return JSONResponse({"error": {"message": "caller went away", "type": "client_closed",
                                               "param": None, "code": "client_closed"}}, status_code=499)
        first_chunk = step.result()
        status, ev = first.result() if first.done() else (200, {})
        if status != 200:
            await gen.aclose()
            return JSONResponse({"error": {"message": ev.get("message"), "type": "decode_error", "param": ev.get("param"),
                                           "code": ev.get("code")}, "crossfill": ev.get("crossfill")},
                                status_code=status,
                                headers={"Retry-After": str(ev["retry_after"])} if ev.get("retry_after") else None)

        async def body() -> AsyncIterator[bytes]:
            yield first_chunk
            async for chunk in gen:
                yield chunk

        return StreamingResponse(body(), media_type="application/x-ndjson")

    return app
