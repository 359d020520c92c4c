"""Getting one request's KV onto this decode instance: attempts in the order `policy.next_attempt` gives.

Per attempt (M5.8): reserve the import first (only the blocks decode does not already hold; a full
decode refuses with 503 before any transfer starts), expect a fresh cache id on the connector,
ask the prefill instance to compute and send (telling it which prefix decode holds), and wait for
both the prefill's first token and the verified commit. Any failure frees the attempt's blocks and
cancels its expectation before the next attempt; the last answer is an explicit error.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from opentelemetry.context import Context

from crossfill.config import CrossfillConfig, Instance
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import NoKVCapacityError
from crossfill.kv.errors import TransferError
from crossfill.observability.tracing import ManifestWatch, SpanKind, Tracing, end_span
from crossfill.policy.attempts import AttemptPlan, Failure, GiveUp, degradation_note, next_attempt
from crossfill.serving.connector import DecodeConnector, Reservation, skipped_raw_bytes
from crossfill.serving.errors import APIError
from crossfill.serving.metrics import ServingMetrics
from crossfill.serving.prefill_client import AttemptFailed, call_prefill
from crossfill.serving.protocol import DecodeJob, FirstToken, PrefillDone, PrefillJob, RouteInfo
from crossfill.serving.streaming import cancel_and_wait, shielded
from crossfill.serving.transfer_tickets import TicketGate

log = logging.getLogger("crossfill.decode")


@dataclass
class Prefilled:
    """Verified KV in the engine, ready to decode from `first_token_id`."""

    reservation: Reservation
    first_token_id: int
    prefill: str
    timings: dict[str, float]
    raw_bytes: int
    wire_bytes: int
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0  # held prefix actually skipped (0 when prefill sent everything)
    wire_bytes_saved: int = 0
    notes: list[str] = field(default_factory=list)


def retry_pause(n: int) -> float:
    """Seconds before the n-th retry of one instance: exponential from 0.1 s, capped at 1 s, full jitter."""
    return random.uniform(0.5, 1.0) * min(0.1 * 2 ** (n - 1), 1.0)


# Called with (prefill instance, wire bytes, seconds, ok, tail seconds) after a transfer (best effort).
# report(prefill instance, wire bytes, seconds, ok, tail seconds, request_id=, tokens=, frames=, retransmits=,
#        trace_headers=)
TransferReport = Callable[..., None]


class KVFetcher:
    def __init__(self, cfg: CrossfillConfig, inst: Instance, engine: Any, connector: DecodeConnector,
                 http: httpx.AsyncClient, metrics: ServingMetrics, report: TransferReport,
                 background: set[asyncio.Task[Any]], tickets: TicketGate | None = None,
                 tracing: Tracing | None = None) -> None:
        self.cfg, self.inst, self.engine, self.connector = cfg, inst, engine, connector
        self.http, self.metrics, self.report, self.background = http, metrics, report, background
        self.tickets = tickets
        self.tracing = tracing or Tracing.off()
        self.instances = {i.name: i for i in cfg.instances()}

    def instance(self, name: str, job: DecodeJob) -> Instance:
        """A configured instance, or one added at run time whose address came with the job."""
        inst = self.instances.get(name)
        if inst is not None:
            return inst
        e = job.endpoints[name]
        return Instance(name, e.role, e.datacenter, e.host, e.port, e.kv_port, self.cfg.http_scheme())

    def _where(self, name: str, job: DecodeJob) -> str:
        return "local" if self.instance(name, job).datacenter == self.inst.datacenter else "remote"

    def _urls(self, name: str, job: DecodeJob) -> tuple[str, tuple[str, int]]:
        """(prefill `name`'s URL, where it sends KV to this instance): through the emulated WAN where
        the config puts one, direct for instances added at run time."""
        pre = self.instance(name, job)
        url = self.cfg.http_url(name) if name in self.instances else pre.url
        if self.inst.name in self.instances and name in self.instances:
            return url, self.cfg.kv_address(self.inst.name, pre.datacenter)
        assert self.inst.kv_port is not None
        return url, (self.inst.host, self.inst.kv_port)

    async def fetch(self, job: DecodeJob, params: SamplingParams, info: RouteInfo, started: float,
                    trace_ctx: Context | None = None) -> Prefilled:
        """`trace_ctx`: decode's request span, the parent of one `decode.kv_attempt` span per attempt."""
        kv = self.cfg.inference_service.kv_cache
        if self.tickets is not None:
            self.tickets.check_decode_job(job)  # 403 before any block is reserved or prefill asked
        plan = AttemptPlan(
            candidates=(job.route.prefill, *job.route.fallbacks),
            prefill_instances=frozenset([*(n for n, i in self.instances.items() if i.role == "prefill"),
                                         *(n for n, e in job.endpoints.items() if e.role == "prefill")]),
            max_retry=kv.max_retry,
            fallback_to_local=self.cfg.inference_service.routing.fallback_to_local_on_failure)
        failures: list[Failure] = []
        while True:
            step = next_attempt(plan, failures)
            if isinstance(step, GiveUp):
                self.metrics.errors.labels(step.code).inc()
                raise APIError(step.status, f"{job.request_id}: {step.message}", code=step.code,
                               retry_after=self.cfg.serving.retry_after_s if step.retry_after else None)
            if failures and failures[-1].instance == step.instance:
                # The same instance again: give a restarting or briefly overloaded peer a moment,
                # jittered so retries of many requests do not arrive in step.
                await asyncio.sleep(retry_pause(sum(f.instance == step.instance for f in failures)))
            try:
                got = await self._attempt(job, params, step.instance, started, trace_ctx, len(failures) + 1)
            except AttemptFailed as exc:
                failures.append(Failure(step.instance, exc.reason, exc.status, exc.retryable))
                info.retries = len(failures)
                self.metrics.retries.inc()
                self.metrics.worker.kv_transfers.labels(self._where(step.instance, job), "failed").inc()
                log.warning("decode %s: KV from %s failed (%s)", job.request_id, step.instance, exc.reason)
                if exc.status >= 500 and exc.status != 503:
                    # A failed transfer or a prefill that broke: evidence about the link for the
                    # scheduler's circuit breaker. A full queue (429) or a refusal is not.
                    self.report(step.instance, 0, 0.0, False, 0.0, request_id=job.request_id,
                                trace_headers=Tracing.headers(trace_ctx))
                continue
            note = degradation_note(plan, failures, step, self._where(step.instance, job))
            if note is not None:
                if step.index > 0:
                    self.metrics.fallbacks.labels("prefill_failed").inc()
                    log.warning("decode %s: FALLBACK %s", job.request_id, note)
                info.degradation_reason = "; ".join(r for r in (info.degradation_reason, note) if r)
            return got

    async def _attempt(self, job: DecodeJob, params: SamplingParams, name: str, started: float,
                       trace_ctx: Context | None = None, attempt: int = 1) -> Prefilled:
        cache_id = f"{job.request_id}.{uuid.uuid4().hex[:12]}"
        span = self.tracing.start("decode.kv_attempt", trace_ctx, kind=SpanKind.CLIENT, attributes={
            "crossfill.attempt": attempt, "crossfill.prefill_instance": name, "crossfill.route": self._where(name, job),
            "crossfill.kv.transport": self.connector.transport, "crossfill.cache_id": cache_id})
        try:
            got = await self._attempt_traced(job, params, name, started, cache_id, Tracing.context(span))
        except AttemptFailed as exc:
            end_span(span, {"crossfill.outcome": "error", "crossfill.status": exc.status}, error="attempt_failed",
                     detail=exc.reason)
            raise
        except APIError as exc:
            end_span(span, {"crossfill.outcome": "error", "crossfill.status": exc.status}, error=exc.code or "error")
            raise
        except asyncio.CancelledError:  # the request ended (client gone, deadline) while this attempt ran
            end_span(span, {"crossfill.outcome": "cancelled"}, error="cancelled")
            raise
        except Exception as exc:
            end_span(span, {"crossfill.outcome": "error"}, error=type(exc).__name__)
            raise
        end_span(span, {"crossfill.outcome": "ok", "crossfill.kv.raw_bytes": got.raw_bytes,
                        "crossfill.kv.wire_bytes": got.wire_bytes, "crossfill.kv.reused_tokens": got.decode_cached_tokens})
        return got

    async def _attempt_traced(self, job: DecodeJob, params: SamplingParams, name: str, started: float,
                              cache_id: str, ctx: Context) -> Prefilled:
        kv = self.cfg.inference_service.kv_cache
        timeout_s = kv.timeout_ms / 1000
        tenant = job.tenant_id or ""
        try:
            res = await self.connector.reserve(self.engine, cache_id, job.prompt_token_ids, params, tenant)
        except NoKVCapacityError as exc:
            raise APIError(503, f"decode instance {self.inst.name} has no free KV blocks: {exc}",
                           code="decode_kv_full", retry_after=self.cfg.serving.retry_after_s) from None
        ok = False
        try:
            # The KV for this cache id is accepted only under a ticket that binds it, this instance,
            # the tenant and the prefill asked now (None when tickets are off).
            authorize = None if self.tickets is None else self.tickets.manifest_check(
                cache_id=cache_id, tenant=tenant, prefill=name)
            watch = ManifestWatch(authorize) if self.tracing.enabled else None  # for decode.kv_import
            authorize = watch or authorize
            self.connector.expect(res, fingerprint=self.engine.fingerprint, prompt=job.prompt_token_ids, tenant=tenant,
                                  authorize=authorize)
            url, (kv_host, kv_port) = self._urls(name, job)
            pjob = PrefillJob(request_id=job.request_id, cache_id=cache_id, prompt_token_ids=job.prompt_token_ids,
                              sampling=params, kv_host=kv_host, kv_port=kv_port, decode_instance=self.inst.name,
                              tenant_id=job.tenant_id, trace_id=job.trace_id,
                              decode_cached_tokens=res.cached_tokens, decode_prefix_digest=res.prefix_digest,
                              ticket=job.ticket)
            t_call = time.perf_counter()
            where = self._where(name, job)  # local | remote: the route label of this transfer's metrics
            first, t_kv = await self._prefill_and_transfer(name, url, pjob, timeout_s, where, ctx, watch)
            raw, wire = self.connector.transfer_bytes(cache_id)
            queue_ms = (t_call - started) * 1000 + first.timings_ms.get("queue", 0.0)
            prefill_ms = first.timings_ms.get("prefill", 0.0)
            transfer_ms = max((t_kv - started) * 1000 - queue_ms - prefill_ms, 0.0)
            self.metrics.transfer.observe(transfer_ms / 1000)
            self.metrics.kv_raw.inc(raw)
            self.metrics.kv_wire.inc(wire)
            self.metrics.worker.kv_transfers.labels(where, "ok").inc()
            self.metrics.worker.kv_raw.labels(where).observe(raw)
            self.metrics.worker.kv_wire.labels(where).observe(wire)
            skipped = first.export_from
            saved = 0
            if skipped:
                # Estimate with this transfer's own compression ratio: what the prefix would have cost.
                skipped_raw = skipped_raw_bytes(self.engine.layer_specs, self.cfg, len(job.prompt_token_ids), skipped)
                saved = int(skipped_raw * (wire / raw)) if raw else skipped_raw
                self.metrics.kv_reused_tokens.inc(skipped)
                self.metrics.kv_saved.inc(saved)
            notes = [f"decode's cached prefix not used: {first.reuse_refused}"] if first.reuse_refused else []
            ok = True
            return Prefilled(res, first.first_token_id, name,
                             {"queue": queue_ms, "prefill": prefill_ms, "transfer": transfer_ms}, raw, wire,
                             prefill_cached_tokens=first.num_cached_tokens, decode_cached_tokens=skipped,
                             wire_bytes_saved=saved, notes=notes)
        finally:
            if not ok:
                self.connector.cancel(cache_id, "attempt abandoned by decode")
                try:
                    await shielded(res.handle.abort())
                except Exception as exc:  # noqa: BLE001 - logged and counted, the attempt is over anyway
                    self.metrics.cleanup_failures.labels("import_abort").inc()
                    log.warning("decode %s: aborting import %s failed: %s", job.request_id, cache_id, exc)

    async def _prefill_and_transfer(self, name: str, url: str, pjob: PrefillJob, timeout_s: float,
                                    where: str = "remote", ctx: Context | None = None,
                                    watch: ManifestWatch | None = None) -> tuple[FirstToken | PrefillDone, float]:
        """Run the prefill call and the transfer wait side by side until both the first token and
        the verified commit are in; the prefill stream then runs on to `done` in the background."""
        cache_id = pjob.cache_id
        t_kv: list[float] = []
        loop = asyncio.get_running_loop()
        first_fut: asyncio.Future[FirstToken | PrefillDone] = loop.create_future()

        async def wait_kv() -> None:
            try:
                await self.connector.wait(cache_id)
            except TransferError as exc:
                self._trace_import(watch, ctx, cache_id, f"kv_{exc.reason.label}")
                raise
            except asyncio.CancelledError:
                self._trace_import(watch, ctx, cache_id, "cancelled")
                raise
            t_kv.append(time.perf_counter())  # when the commit verified, not when we noticed
            self._trace_import(watch, ctx, cache_id, None)

        def on_first(ev: FirstToken | PrefillDone) -> None:
            self.connector.notify(cache_id)  # the sender is committing now: a store puller may look
            if not first_fut.done():
                first_fut.set_result(ev)

        kv_task = asyncio.create_task(wait_kv())
        # A prefill queued behind others, or slow on a busy machine, is late, not lost: its
        # heartbeats hold the KV wait open until its first token (then everything it computed is
        # on the wire and only KV frames count, so a stalled link is still caught).
        pre_task = asyncio.create_task(call_prefill(self.http, url, pjob, timeout_s, on_first,
                                                    on_alive=lambda: self.connector.keep_alive(cache_id),
                                                    trace_headers=Tracing.headers(ctx)))
        got_both = False
        try:
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
                await cancel_and_wait(kv_task, pre_task)
        self._finish_in_background(pre_task, name, pjob, where, ctx)
        return first_fut.result(), t_kv[0]

    def _trace_import(self, watch: ManifestWatch | None, ctx: Context | None, cache_id: str,
                      error: str | None) -> None:
        """`decode.kv_import`: from the manifest's arrival to the verified commit (or the failure), under
        the sender's `kv.send` span named in the manifest. Nothing when no manifest arrived."""
        if watch is None or watch.arrived_ns is None:
            return
        parent = self.tracing.from_traceparent(watch.traceparent) or ctx
        raw, wire = self.connector.transfer_bytes(cache_id)
        span = self.tracing.start("decode.kv_import", parent, kind=SpanKind.CONSUMER, start_ns=watch.arrived_ns,
                                  attributes={"crossfill.cache_id": cache_id,
                                              "crossfill.kv.transport": self.connector.transport})
        end_span(span, {"crossfill.outcome": "ok" if error is None else "error", "crossfill.kv.raw_bytes": raw,
                        "crossfill.kv.wire_bytes": wire}, error=error)

    def _finish_in_background(self, pre_task: asyncio.Task[PrefillDone], name: str, job: PrefillJob,
                              where: str, ctx: Context | None = None) -> None:
        """Let the prefill stream reach `done`, then report the transfer to the scheduler."""
        self.background.add(pre_task)

        def done(t: asyncio.Task[PrefillDone]) -> None:
            self.background.discard(t)
            if t.cancelled() or t.exception() is not None:
                return
            done_event = t.result()
            k = done_event.kv
            self.metrics.worker.kv_duration.labels(where).observe(k.duration_s)
            self.report(name, k.wire_bytes, k.duration_s, True, k.commit_wait_s, request_id=job.request_id,
                        tokens=len(job.prompt_token_ids) - done_event.export_from, frames=k.frames,
                        retransmits=k.retransmits, trace_headers=Tracing.headers(ctx))

        pre_task.add_done_callback(done)
