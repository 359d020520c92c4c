"""The gateway: OpenAI-compatible API and the seed's native /v1/generate, in front of the cluster.

Per request: validate the body (400 naming the field), tokenize (chat template for chat), check
the context limit, ask the scheduler for a route, hand the job to the chosen decode instance and
relay its event stream as OpenAI JSON or SSE. Every response carries the route report: the
`crossfill` object in the body (and the final stream chunk) and the `x-crossfill-route` header.

The gateway waits for decode's first event before answering, so refusals and failures before the
first token (full queues, failed transfers with no fallback, prompts past the context) arrive as
proper HTTP statuses with Retry-After where it applies; a failure after the first token ends the
stream with an error chunk, never a silent hang. A client that disconnects closes the stream to
decode, which aborts the request everywhere (decode and prefill free its KV).

Nothing the client has not seen is lost to a restarting process (M5.8, M8.4): within
`serving.retry_budget_s`, with exponential backoff and jitter, the gateway retries a scheduler
that is unreachable or starting, and routes the request again — preferring another decode
instance — when the chosen decode is unreachable, draining, or breaks its stream before the
client got a token (for a non-streamed request: before the answer is complete). The request id
stays the same across these tries. Each reschedule is counted and named in the route's
degradation reason. After a token reached a streaming client, a failure is an explicit error chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.context import Context
from opentelemetry.trace import Span
from pydantic import TypeAdapter

from crossfill.config import CrossfillConfig
from crossfill.engine.block_pool import prompt_block_hashes
from crossfill.engine.sampling import SamplingParams
from crossfill.observability.dashboard_api import RecentRoutes, add_dashboard_routes
from crossfill.observability.metrics_defs import STAGES, TenantLabels
from crossfill.observability.request_log import RequestLog
from crossfill.observability.tracing import Tracing, end_span, perf_to_ns
from crossfill.policy.routing import Route
from crossfill.security.audit import open_audit
from crossfill.security.auth import Authenticator
from crossfill.security.limits import AuditThrottle, BodyLimits, LimitExceeded, TenantLimiter
from crossfill.security.tls_http import client_kwargs
from crossfill.serving import openapi_doc
from crossfill.serving.connector import import_namespace
from crossfill.serving.errors import APIError, install_error_handlers, parse_body
from crossfill.serving.health import Readiness, add_health_routes
from crossfill.serving.metrics import ServingMetrics, add_metrics_route
from crossfill.serving.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    GenerateChunk,
    GenerateResponse,
    ModelList,
)
from crossfill.serving.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
)
from crossfill.serving.protocol import (
    PREFIX_BLOCK_SIZE,
    ROUTE_PREFIX_MAX_BLOCKS,
    DecodeJob,
    Delta,
    Done,
    Endpoint,
    ErrorEvent,
    Routed,
    RouteInfo,
    Usage,
    parse_decode_event,
)
from crossfill.serving.streaming import ClosingStreamingResponse, cancel_and_wait, shielded
from crossfill.serving.worker_common import InFlight, drain, release_when_request_ends

log = logging.getLogger("crossfill.gateway")
_ROUTE: TypeAdapter[Route] = TypeAdapter(Route)
T = TypeVar("T")
M = TypeVar("M", bound=SamplingFields)
_TRANSIENT = ("not_ready", "draining")  # a 503 with one of these codes: the same call may work soon


class Reschedule(Exception):
    """The chosen decode instance failed before the client saw anything: route the request again."""

    def __init__(self, decode: str, error: APIError) -> None:
        super().__init__(error.message)
        self.decode = decode
        self.error = error


class DecodeSilent(httpx.TransportError):
    """The decode instance serving a request stopped answering (hung, stopped, or cut off)."""


_WATCH_S = 2.0  # a wait on decode longer than this starts health checks of that decode
_WATCH_TIMEOUT_S = 5.0  # generous: a busy decode is slow, a stopped one never answers
_WATCH_MISSES = 3  # unanswered health checks in a row before decode counts as silent


async def _next_line(lines: AsyncIterator[str]) -> str | None:
    try:
        return await anext(lines)
    except StopAsyncIteration:
        return None


class Backoff:
    """Exponential backoff with full jitter, bounded by a time budget (`serving.retry_budget_s`)."""

    def __init__(self, budget_s: float, first_s: float = 0.2, cap_s: float = 2.0) -> None:
        self.deadline = time.monotonic() + budget_s
        self.delay = first_s
        self.cap = cap_s
        self.tries = 0

    async def wait(self) -> bool:
        """Sleep before the next try; False when the budget does not allow one."""
        pause = random.uniform(self.delay / 2, self.delay)  # jitter: restarted peers are not hit in step
        if time.monotonic() + pause > self.deadline:
            return False
        await asyncio.sleep(pause)
        self.delay = min(self.delay * 2, self.cap)
        self.tries += 1
        return True


class ModelFacts:
    """Tokenizer and context limit of the served model (the gateway never loads the weights)."""

    def __init__(self, cfg: CrossfillConfig) -> None:
        from crossfill.models import load_config, load_tokenizer, resolve_model

        files = resolve_model(cfg.model.name, pull=False)
        self.tokenizer = load_tokenizer(files)
        mcfg = load_config(files)
        limit = int(getattr(mcfg, "max_position_embeddings", 0) or 2048)
        self.max_model_len = min(cfg.model.max_model_len or limit, limit)
        self.vocab_size = int(getattr(mcfg, "vocab_size", 0) or len(self.tokenizer))
        self.name = cfg.model.api_name

    def chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's message structure
            raise APIError(400, f"messages cannot be rendered with the model's chat template: {exc}",
                           param="messages", code="invalid_messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def text_tokens(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]


@dataclass
class _Job:
    kind: str  # chat | completion | generate
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    fields: SamplingFields
    arrived: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    reschedules: list[str] = field(default_factory=list)  # decode failures before the client saw a token
    trace_id: str | None = None  # one per request, kept across reschedules
    span: Span | None = None  # the request's root span (gateway.request), ended by log_request
    trace_ctx: Context | None = None  # its context: every hop of the request carries it as `traceparent`
    ticket: str | None = None  # the scheduler's transfer ticket for the current route (new with each route)


class Gateway:
    def __init__(self, cfg: CrossfillConfig, facts: ModelFacts | None = None) -> None:
        self.cfg = cfg
        self.facts = facts
        self.readiness = Readiness("gateway", "gateway")
        self.metrics = ServingMetrics("gateway", "gateway", cfg.topology.local_datacenter)
        self.tenant_label = TenantLabels(cfg)  # bounded `tenant` label values
        self.request_log = RequestLog("gateway", "gateway")
        self.recent = RecentRoutes()  # the last finished requests' route reports, for /dashboard (no text)
        self.http: httpx.AsyncClient | None = None
        self.scheduler_url = cfg.scheduler_url()
        self._tls = client_kwargs(cfg, "gateway")  # mutual TLS to the scheduler and decode; {} when off
        self.tracing = Tracing(cfg, "gateway", "gateway", cfg.topology.local_datacenter)
        self.requests = InFlight()
        self.metrics.queue.set_function(lambda: self.requests.count)
        self.request_ids: set[str] = set()  # ids of the requests in flight (see claim_id)
        self.audit = open_audit(cfg, "gateway")
        self.auth = Authenticator.from_config(cfg, self.audit)  # ConfigError when auth is on and no key exists
        self.limiter = TenantLimiter(cfg.security.limits, stream_retry_after_s=cfg.serving.retry_after_s)
        self._limit_audit = AuditThrottle(burst=1, per_s=1)  # one limit_exceeded record per tenant per second

    def claim_id(self, request_id: str) -> None:
        """Hold `request_id` until its request ends. Workers key aborts and KV by it, so a second request
        with an id in flight (a client-chosen /v1/generate id) would abort the first: it gets a 409 instead."""
        if request_id in self.request_ids:
            raise APIError(409, f"a request with request_id {request_id!r} is in flight; ids must be unique",
                           param="request_id", code="duplicate_request_id")
        self.request_ids.add(request_id)
        release_when_request_ends(lambda: self.request_ids.discard(request_id))

    def admit(self, job: _Job) -> None:
        """Count `job` against its tenant's limits until the request ends (429 when over one)."""
        tenant = job.fields.tenant_id or ""
        try:
            release = self.limiter.admit(tenant, len(job.prompt_token_ids) + job.sampling.max_tokens)
        except LimitExceeded as exc:
            dropped = self._limit_audit.allow(tenant) if self.audit is not None else None
            if self.audit is not None and dropped is not None:
                self.audit.record("limit_exceeded", tenant=tenant, code=exc.code, **({"suppressed": dropped} if dropped else {}))
            raise
        release_when_request_ends(release)

    async def drain(self) -> None:
        await drain(self.readiness, self.requests, "gateway")

    async def start(self) -> None:
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.cfg.serving.request_timeout_s, connect=5.0),
                                      trust_env=False, limits=httpx.Limits(max_connections=1000), **self._tls)
        try:
            if self.facts is None:
                self.readiness.set_not_ready("loading tokenizer")
                self.facts = await asyncio.to_thread(ModelFacts, self.cfg)
        except Exception as exc:  # noqa: BLE001 - stay up, not ready, say why
            log.exception("gateway cannot load the model's tokenizer")
            self.readiness.set_not_ready(f"cannot load tokenizer: {exc}")
            return
        # Ready when the scheduler is: before that every request would be refused anyway.
        while True:
            try:
                r = await self.http.get(self.scheduler_url + "/readyz", timeout=2.0)
                if r.status_code == 200:
                    self.readiness.set_ready()
                else:
                    self.readiness.set_not_ready(f"scheduler not ready: {r.json().get('reason')}")
            except (httpx.HTTPError, ValueError) as exc:
                self.readiness.set_not_ready(f"scheduler unreachable: {type(exc).__name__}")
            await asyncio.sleep(0.5 if not self.readiness.ready else 2.0)

    # -- request building -------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        assert self.facts is not None
        if model is not None and model != self.facts.name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.facts.name}' "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def _job(self, kind: str, request_id: str, model: str, tokens: list[int], fields: SamplingFields,
             max_tokens: int | None) -> _Job:
        assert self.facts is not None
        limit = self.facts.max_model_len
        if not tokens:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt", code="empty_prompt")
        if len(tokens) >= limit:
            raise APIError(400, f"the prompt has {len(tokens)} tokens; this model's context is {limit} tokens",
                           param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - len(tokens)
        if len(tokens) + max_tokens > limit:
            raise APIError(400, f"max_tokens {max_tokens} + prompt {len(tokens)} tokens exceeds the context of "
                           f"{limit} tokens", param="max_tokens", code="context_length_exceeded")
        try:
            sampling = SamplingParams(max_tokens=max_tokens, **fields.sampling_kwargs())
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_sampling") from None
        return _Job(kind, request_id, model, tokens, sampling, fields)

    # -- the cluster round trip ---------------------------------------------------------------------
    async def route(self, job: _Job, backoff: Backoff, avoid: list[str]) -> tuple[Route, dict[str, Endpoint]]:
        """Ask the scheduler for a route, retrying while it is unreachable or starting."""
        assert self.http is not None
        # No refusal on our own /readyz (it mirrors the scheduler's with a lag): the scheduler
        # answers for the cluster's state at this moment.
        f = job.fields
        query: dict[str, Any] = {"request_id": job.request_id, "prompt_tokens": len(job.prompt_token_ids),
                                 "prefill_policy": f.prefill_policy, "tenant_id": f.tenant_id,
                                 "avoid_decode": avoid, "request_type": f.request_type}
        routing = self.cfg.inference_service.routing
        # A batch request may wait in the scheduler's batch queue for spare capacity.
        batch = (f.request_type or routing.tenant(f.tenant_id).request_type) == "batch"
        route_timeout = routing.batch_max_wait_s + 10.0 if batch else 10.0
        # The prompt's blocks as chain hashes for the scheduler's KV index (never the tokens): in
        # the namespace prefill caches under, and in decode's import namespace when that differs.
        tenant = f.tenant_id or ""
        decode_ns = import_namespace(self.cfg, tenant)
        for key, namespace in (("prefix_hashes", tenant), ("decode_prefix_hashes", decode_ns)):
            if key == "prefix_hashes" or namespace != tenant:
                query[key] = prompt_block_hashes(job.prompt_token_ids, namespace, PREFIX_BLOCK_SIZE,
                                                 max_blocks=ROUTE_PREFIX_MAX_BLOCKS)
        while True:
            try:
                r = await self.http.post(self.scheduler_url + "/v1/route", json=query, timeout=route_timeout,
                                         headers=Tracing.headers(job.trace_ctx))
                body = _json(r)
                if r.status_code == 200:
                    endpoints = {n: Endpoint.model_validate(e) for n, e in (body.pop("endpoints", None) or {}).items()}
                    job.ticket = body.pop("ticket", None)
                    return _ROUTE.validate_python(body), endpoints
                err = APIError.from_body(r.status_code, body, r.headers.get("retry-after"))
                # A request being routed again was accepted already: wait for a decode instance to
                # come back (within the budget) rather than fail it; a new one is refused at once.
                transient = (*_TRANSIENT, "no_decode_instance") if avoid else _TRANSIENT
                if r.status_code != 503 or err.code not in transient:
                    raise err
            except httpx.HTTPError as exc:
                err = APIError(503, f"scheduler unreachable: {type(exc).__name__}", code="scheduler_unavailable",
                               retry_after=self.cfg.serving.retry_after_s)
            if not await backoff.wait():
                raise err
            self.metrics.fallbacks.labels("scheduler_retry").inc()
            log.info("request %s: scheduler %s; trying again (try %d)", job.request_id, err.code, backoff.tries)

    async def submit(self, job: _Job, backoff: Backoff | None = None, avoid: list[str] | None = None,
                     ) -> tuple[RouteInfo, AsyncIterator[Routed | Delta | Done | ErrorEvent]]:
        """Route and start `job`; returns (route info, the remaining events).

        Decode failures before its first event are retried here (routed again, preferring
        another decode instance); what is left of `backoff` bounds the caller's own retries.
        """
        backoff = backoff or Backoff(self.cfg.serving.retry_budget_s)
        avoid = avoid if avoid is not None else []
        while True:
            route, endpoints = await self.route(job, backoff, avoid)
            try:
                return await self._start(job, route, endpoints)
            except Reschedule as exc:
                if not await backoff.wait():
                    raise exc.error from None
                self.note_reschedule(job, exc, avoid)

    async def watched(self, aw: Awaitable[T], decode_url: str, name: str) -> T:
        """Await `aw` while checking that decode still answers when it takes long (M8.4, "decode silent").

        A decode that is hung or stopped keeps its TCP connection open, so the stream alone would
        wait up to the request deadline; after `_WATCH_MISSES` unanswered `/healthz` checks the
        wait ends with `DecodeSilent` (rescheduled before the first token, an explicit error after).
        """
        assert self.http is not None
        task = asyncio.ensure_future(aw)
        probe: asyncio.Future[bool] | None = None
        misses = 0
        try:
            while True:
                waits: set[asyncio.Future[Any]] = {task} if probe is None else {task, probe}
                done, _ = await asyncio.wait(waits, timeout=_WATCH_S if probe is None else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if probe is None:
                    probe = asyncio.ensure_future(self._answers(decode_url))
                elif probe.done():
                    misses = 0 if probe.result() else misses + 1
                    probe = None
                    if misses >= _WATCH_MISSES:
                        self.metrics.errors.labels("decode_silent").inc()
                        raise DecodeSilent(f"decode instance {name} stopped answering ({misses} health checks "
                                           "unanswered)")
        finally:
            await cancel_and_wait(task, probe)

    async def _answers(self, url: str) -> bool:
        assert self.http is not None
        try:
            return (await self.http.get(url + "/healthz", timeout=_WATCH_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False

    def note_reschedule(self, job: _Job, exc: Reschedule, avoid: list[str]) -> None:
        if exc.decode not in avoid:
            avoid.append(exc.decode)
        job.reschedules.append(f"decode {exc.decode}: {exc.error.message}")
        self.metrics.fallbacks.labels("reschedule").inc()
        log.warning("request %s: decode %s failed before any token reached the client (%s); routing it again",
                    job.request_id, exc.decode, exc.error.message)

    async def _start(self, job: _Job, route: Route, endpoints: dict[str, Endpoint],
                     ) -> tuple[RouteInfo, AsyncIterator[Routed | Delta | Done | ErrorEvent]]:
        assert self.http is not None
        f = job.fields
        job.trace_id = job.trace_id or f.trace_id or (uuid.uuid4().hex if self.tracing.enabled else None)
        trace_id = job.trace_id
        dec_url = (endpoints[route.decode].url(self.cfg.http_scheme()) if route.decode in endpoints
                   else self.cfg.instance(route.decode).url)
        djob = DecodeJob(request_id=job.request_id, prompt_token_ids=job.prompt_token_ids, sampling=job.sampling,
                         route=route, tenant_id=f.tenant_id, trace_id=trace_id,
                         deadline_s=self.cfg.serving.request_timeout_s, endpoints=endpoints, ticket=job.ticket)
        routed_ms = (time.perf_counter() - job.arrived) * 1000
        stack = contextlib.AsyncExitStack()

        async def open_stream() -> tuple[AsyncIterator[str], Routed | Delta | Done | ErrorEvent]:
            try:
                resp = await stack.enter_async_context(
                    self.http.stream("POST", dec_url + "/v1/decode", content=djob.model_dump_json(),  # type: ignore[union-attr]
                                     headers={"content-type": "application/json", **Tracing.headers(job.trace_ctx)}))
            except httpx.HTTPError as exc:
                raise Reschedule(route.decode, APIError(
                    503, f"decode instance {route.decode} unreachable: {type(exc).__name__}",
                    code="decode_unavailable", retry_after=self.cfg.serving.retry_after_s)) from None
            if resp.status_code != 200:
                err = APIError.from_body(resp.status_code, _json_bytes(await resp.aread()),
                                         resp.headers.get("retry-after"))
                if resp.status_code == 503 and err.code in _TRANSIENT:
                    raise Reschedule(route.decode, err)
                raise err
            lines = resp.aiter_lines()
            try:
                while not (line := await anext(lines)):
                    pass
                return lines, parse_decode_event(line)
            except (StopAsyncIteration, httpx.HTTPError, ValueError) as exc:
                raise Reschedule(route.decode, APIError(502, f"decode instance {route.decode} ended the stream early: "
                                                        f"{exc!r}", code="decode_failed")) from None

        try:
            try:
                lines, first = await self.watched(open_stream(), dec_url, route.decode)
            except DecodeSilent as exc:
                raise Reschedule(route.decode, APIError(504, str(exc), code="decode_silent")) from None
        except BaseException:
            # Covers cancellation too (client gone): closing the stream makes decode abort everywhere.
            await shielded(stack.aclose())
            raise

        async def events() -> AsyncIterator[Routed | Delta | Done | ErrorEvent]:
            try:
                while (line := await self.watched(_next_line(lines), dec_url, route.decode)) is not None:
                    if line:
                        yield parse_decode_event(line)
            finally:
                await shielded(stack.aclose())

        it = events()
        crossfill = first.crossfill if isinstance(first, Routed | ErrorEvent) else None
        info = crossfill or RouteInfo(request_id=job.request_id)
        info.timings_ms["queue"] = info.timings_ms.get("queue", 0.0) + routed_ms
        _note_reschedules(job, info)
        if isinstance(first, ErrorEvent):
            await it.aclose()
            raise APIError(first.status, first.message, code=first.code, param=first.param,
                           retry_after=first.retry_after, extra={"crossfill": info.as_dict()})
        if not isinstance(first, Routed):
            await it.aclose()
            raise APIError(502, f"decode instance {route.decode} started with a {first.event!r} event, not 'routed'",
                           code="decode_failed")
        return info, it

    def finish_info(self, job: _Job, info: RouteInfo, final: Done, t_first: float | None) -> RouteInfo:
        done = (final.crossfill or info).model_copy(deep=True)
        _note_reschedules(job, done)
        done.timings_ms["queue"] = info.timings_ms.get("queue", 0.0)
        now = time.perf_counter()
        if t_first is not None:
            done.timings_ms["first_token"] = (t_first - job.arrived) * 1000
            self.metrics.ttft.labels(done.route).observe(t_first - job.arrived)
        done.timings_ms["total"] = (now - job.arrived) * 1000
        self.metrics.e2e.labels(done.route).observe(now - job.arrived)
        for stage in STAGES:
            if stage in done.timings_ms:
                self.metrics.gw.stage.labels(stage, done.route).observe(done.timings_ms[stage] / 1000)
        tenant = self.tenant_label(done.tenant_id)
        self.metrics.gw.prompt_tokens.labels(done.route, tenant).inc(final.usage.prompt_tokens)
        self.metrics.gw.output_tokens.labels(done.route, tenant).inc(final.usage.completion_tokens)
        if done.degradation_reason:
            self.metrics.fallbacks.labels("degraded").inc()
        self.log_request(done, final.finish_reason, usage=final.usage, span=job.span)
        return done

    def start_trace(self, job: _Job, headers: Mapping[str, str]) -> None:
        """Open the request's root span. A client's `trace_id` is what the route report shows (of 32
        hex digits, it is the trace id too); without one, the report shows the trace id."""
        f = job.fields
        job.span = self.tracing.start_root("gateway.request", headers=headers, trace_id=f.trace_id, attributes={
            "crossfill.request_id": job.request_id, "crossfill.api": job.kind, "crossfill.tenant_id": f.tenant_id,
            "crossfill.prompt_tokens": len(job.prompt_token_ids), "crossfill.max_tokens": job.sampling.max_tokens,
            "crossfill.stream": bool(f.stream), "crossfill.prefill_policy": f.prefill_policy,
            "crossfill.client_trace_id": f.trace_id}, start_ns=perf_to_ns(job.arrived))  # from arrival, as TTFT
        job.trace_ctx = Tracing.context(job.span)
        job.trace_id = f.trace_id or Tracing.trace_id(job.span)

    def log_request(self, info: RouteInfo, finish: str | None, error: str | None = None, *,
                    outcome: str | None = None, error_code: str | None = None, usage: Usage | None = None,
                    span: Span | None = None) -> None:
        """Count the finished request (`crossfill_requests_total{outcome}`) and write its JSON log line.

        `outcome`: ok, error (nothing reached the client), error_after_first_token, client_closed.
        """
        outcome = outcome or ("error" if error else "ok")
        route = info.route if info.decode_instance or info.prefill_instance else "none"
        self.metrics.requests.labels(route, outcome).inc()
        self.metrics.gw.by_tenant.labels(self.tenant_label(info.tenant_id), route, outcome).inc()
        self.recent.add(info, outcome, error_code, usage)
        self.request_log.emit("request", info, status=outcome, error_code=error_code, error=error,
                              finish_reason=finish, kv_raw_bytes=info.kv_raw_bytes, kv_wire_bytes=info.kv_wire_bytes,
                              prefill_cached_tokens=info.prefill_cached_tokens,
                              decode_cached_tokens=info.decode_cached_tokens)
        if span is not None:  # the request's root span ends with its outcome
            end_span(span, {"crossfill.outcome": outcome, "crossfill.route": route, "crossfill.finish_reason": finish,
                            "crossfill.prefill_instance": info.prefill_instance,
                            "crossfill.decode_instance": info.decode_instance, "crossfill.cache_id": info.cache_id,
                            "crossfill.retries": info.retries, "crossfill.degradation_reason": info.degradation_reason,
                            "crossfill.ttft_ms": info.timings_ms.get("first_token"),
                            "crossfill.completion_tokens": usage.completion_tokens if usage else None},
                     error=None if outcome == "ok" else error_code or outcome)


def _first_token(job: _Job) -> None:
    """Mark the first token's arrival on the request's span (TTFT in the trace)."""
    if job.span is not None:
        job.span.add_event("first_token")


def _note_reschedules(job: _Job, info: RouteInfo) -> None:
    """Name the decode failures this request was rescheduled after in its degradation reason."""
    if job.reschedules:
        note = f"rescheduled after {'; '.join(job.reschedules)}"
        if note not in (info.degradation_reason or ""):
            info.degradation_reason = "; ".join(r for r in (info.degradation_reason, note) if r)


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _json_bytes(b: bytes) -> Any:
    try:
        return json.loads(b)
    except ValueError:
        return None


# --------------------------------------------------------------------------- response formats


def _choice_delta(kind: str, text: str, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _object(kind: str, stream: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def create_gateway_app(cfg: CrossfillConfig, facts: ModelFacts | None = None) -> FastAPI:
    gw = Gateway(cfg, facts)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(gw.start())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            if gw.http is not None:
                await gw.http.aclose()
            gw.tracing.shutdown()  # the last spans are written before the process exits

    app = FastAPI(title="crossfill gateway", lifespan=lifespan)
    openapi_doc.install(app, cfg.model.api_name, cfg.security.auth.enabled)
    install_error_handlers(app)
    lim = cfg.security.limits
    app.add_middleware(BodyLimits, max_bytes=lim.max_body_bytes, timeout_s=lim.client_body_timeout_s)
    add_health_routes(app, gw.readiness)
    add_metrics_route(app, gw.metrics, cfg.inference_service.observability.metrics_enabled)
    add_dashboard_routes(app, gw)  # /dashboard/: the page (no key), its state (admin key when auth is on)
    app.state.gateway = gw
    app.state.drain = gw.drain

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> JSONResponse:
        # Nobody reads this; 499 (nginx's "client closed request") keeps access logs honest.
        return APIError(499, "client closed the request", code="client_closed").response()

    def counted(handler: Callable[[Request], Awaitable[T]]) -> Callable[[Request], Awaitable[T]]:
        """Count and log a request refused before it was admitted (no key, bad body, unknown model,
        prompt past the context); respond() counts and logs every admitted one itself."""
        @functools.wraps(handler)
        async def wrapper(request: Request) -> T:
            try:
                return await handler(request)
            except APIError as exc:
                if not getattr(exc, "logged", False):
                    gw.metrics.errors.labels(exc.code or "error").inc()
                    gw.log_request(RouteInfo(request_id=""), None, f"{exc.status} {exc.code}: {exc.message}",
                                   error_code=exc.code or "error")
                raise
        return wrapper

    def need_facts() -> ModelFacts:
        if gw.facts is None:
            raise APIError(503, f"the gateway is not ready: {gw.readiness.reason}", code="not_ready",
                           retry_after=cfg.serving.retry_after_s)
        return gw.facts

    async def read_request(request: Request, model: type[M]) -> M:
        """Authenticate, then read the body (a caller without a key gets its 401 before any parsing); the
        key's tenant becomes the request's tenant, so everything downstream (routing, prefix-cache and KV
        namespaces, the route report) uses it and never a tenant the body claims."""
        ident = gw.auth.authenticate(request)
        req = await parse_body(request, model)
        req.tenant_id = gw.auth.tenant(request, ident, req.tenant_id)
        return req

    @app.get("/v1/models", response_model=None, responses=openapi_doc.responses(ModelList, errors=(401, 429)))
    async def models(request: Request) -> dict[str, Any]:
        gw.auth.authenticate(request)  # as OpenAI: listing models needs a key too
        return {"object": "list", "data": [{"id": cfg.model.api_name, "object": "model", "created": 0,
                                            "owned_by": "crossfill"}]}

    @app.post("/v1/chat/completions", response_model=None,
              openapi_extra=openapi_doc.request_body(ChatCompletionRequest, openapi_doc.CHAT_EXAMPLES),
              responses=openapi_doc.responses(ChatCompletion, ChatCompletionChunk))
    @counted
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        req = await read_request(request, ChatCompletionRequest)
        facts = need_facts()
        gw._check_model(req.model)
        job = gw._job("chat", f"chatcmpl-{uuid.uuid4().hex[:24]}", req.model, facts.chat_tokens(req), req,
                      req.token_limit())
        return await respond(job, request)

    @app.post("/v1/completions", response_model=None,
              openapi_extra=openapi_doc.request_body(CompletionRequest, openapi_doc.COMPLETION_EXAMPLES),
              responses=openapi_doc.responses(Completion, CompletionChunk))
    @counted
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        req = await read_request(request, CompletionRequest)
        facts = need_facts()
        gw._check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported")
        tokens = list(req.prompt) if isinstance(req.prompt, list) else facts.text_tokens(req.prompt)
        if isinstance(req.prompt, list) and max(tokens) >= facts.vocab_size:
            raise APIError(400, f"prompt token id {max(tokens)} is outside the vocabulary (size {facts.vocab_size})",
                           param="prompt", code="invalid_token_id")
        job = gw._job("completion", f"cmpl-{uuid.uuid4().hex[:24]}", req.model, tokens, req, req.max_tokens)
        return await respond(job, request)

    @app.post("/v1/generate", response_model=None,
              openapi_extra=openapi_doc.request_body(GenerateRequest, openapi_doc.GENERATE_EXAMPLES),
              responses=openapi_doc.responses(GenerateResponse, GenerateChunk, (*openapi_doc.POST_ERRORS, 409)))
    @counted
    async def generate(request: Request) -> JSONResponse | StreamingResponse:
        req = await read_request(request, GenerateRequest)
        facts = need_facts()
        gw._check_model(req.model)
        rid = req.request_id or f"gen-{uuid.uuid4().hex[:24]}"
        job = gw._job("generate", rid, req.model or facts.name, facts.text_tokens(req.prompt), req, req.max_tokens)
        return await respond(job, request)

    async def respond(job: _Job, request: Request) -> JSONResponse | StreamingResponse:
        if gw.readiness.draining:
            raise APIError(503, "the gateway is draining (shutting down); retry shortly", code="draining",
                           retry_after=cfg.serving.retry_after_s)
        gw.claim_id(job.request_id)
        gw.requests.enter()
        release_when_request_ends(gw.requests.leave)
        backoff, avoid = Backoff(cfg.serving.retry_budget_s), []
        gw.start_trace(job, request.headers)
        try:
            gw.admit(job)
            if job.fields.stream:
                info, events = await until_disconnect(request, gw.submit(job, backoff, avoid))
                return ClosingStreamingResponse(stream(job, info, events), media_type="text/event-stream",
                                                headers={"x-crossfill-route": info.header(),
                                                         "x-request-id": job.request_id})
            return await until_disconnect(request, complete(job, backoff, avoid))
        except APIError as exc:
            gw.metrics.errors.labels(exc.code or "error").inc()
            ri = RouteInfo.from_dict(exc.extra.get("crossfill") or {"request_id": job.request_id,
                                                                     "tenant_id": job.fields.tenant_id})
            gw.log_request(ri, None, f"{exc.status} {exc.code}: {exc.message}", error_code=exc.code or "error",
                           span=job.span)
            exc.logged = True  # type: ignore[attr-defined]  # not again by `counted`
            raise
        except ClientGone:
            gw.log_request(RouteInfo(request_id=job.request_id, tenant_id=job.fields.tenant_id), None,
                           "client closed the request", outcome="client_closed", error_code="client_closed",
                           span=job.span)
            raise
        except Exception as exc:  # unforeseen (a 500): the trace still shows the request, failed
            if job.span is not None:
                end_span(job.span, error=type(exc).__name__)
            raise

    async def complete(job: _Job, backoff: Backoff, avoid: list[str]) -> JSONResponse:
        """A non-streamed answer: until it is complete the client saw nothing, so a broken decode is retried."""
        while True:
            info, events = await gw.submit(job, backoff, avoid)
            headers = {"x-crossfill-route": info.header(), "x-request-id": job.request_id}
            try:
                return await collect(job, info, events, headers)
            except Reschedule as exc:
                if not await backoff.wait():
                    raise exc.error from None
                gw.note_reschedule(job, exc, avoid)

    async def collect(job: _Job, info: RouteInfo, events: AsyncIterator[Routed | Delta | Done | ErrorEvent],
                      headers: dict[str, str]) -> JSONResponse:
        text: list[str] = []
        token_ids: list[int] = []
        t_first: float | None = None
        try:
            async for ev in events:
                if isinstance(ev, Delta):
                    if t_first is None:
                        t_first = time.perf_counter()
                        _first_token(job)
                    text.append(ev.text)
                    token_ids.extend(ev.token_ids)
                elif isinstance(ev, Done):
                    done = gw.finish_info(job, info, ev, t_first)
                    body = _final_body(job, "".join(text), token_ids, ev, done)
                    return JSONResponse(body, headers={**headers, "x-crossfill-route": done.header()})
                elif isinstance(ev, ErrorEvent):
                    raise APIError(ev.status, ev.message, code=ev.code,
                                   extra={"crossfill": ev.crossfill.as_dict() if ev.crossfill else None})
        except (httpx.HTTPError, ValueError) as exc:
            raise Reschedule(info.decode_instance or "?", APIError(
                502, f"decode stream broke: {type(exc).__name__}: {exc}", code="decode_failed")) from None
        finally:
            await shielded(events.aclose())  # type: ignore[attr-defined]
        raise Reschedule(info.decode_instance or "?", APIError(502, "decode stream ended without a result",
                                                                code="decode_failed"))

    async def stream(job: _Job, info: RouteInfo,
                     events: AsyncIterator[Routed | Delta | Done | ErrorEvent]) -> AsyncIterator[bytes]:
        base = {"id": job.request_id, "object": _object(job.kind, True), "created": job.created, "model": job.model}
        t_first: float | None = None
        include_usage = bool(job.fields.stream_options and job.fields.stream_options.include_usage)
        ended = False  # the stream reached its final chunk (result or error): anything else is the client leaving
        try:
            if job.kind == "chat":
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                yield _sse({**base, "choices": [role]})
            async for ev in events:
                if isinstance(ev, Delta):
                    if t_first is None:
                        t_first = time.perf_counter()
                        _first_token(job)
                    chunk = {**base, "choices": [_choice_delta(job.kind, ev.text, None)]}
                    if job.kind == "generate":
                        chunk["token_ids"] = ev.token_ids
                    yield _sse(chunk)
                elif isinstance(ev, Done):
                    done = gw.finish_info(job, info, ev, t_first)
                    final = {**base, "choices": [_choice_delta(job.kind, "", ev.finish_reason)],
                             "crossfill": done.as_dict()}
                    if include_usage or job.kind == "generate":
                        final["usage"] = _usage(ev)
                    ended = True
                    yield _sse(final)
                    yield b"data: [DONE]\n\n"
                    return
                elif isinstance(ev, ErrorEvent):
                    ended = True
                    gw.metrics.errors.labels(ev.code or "error").inc()
                    gw.log_request(ev.crossfill or info, None, f"{ev.status} {ev.code}: {ev.message}",
                                   outcome="error" if t_first is None else "error_after_first_token",
                                   error_code=ev.code or "error", span=job.span)
                    yield _sse(APIError(ev.status, ev.message, code=ev.code,
                                        extra={"crossfill": ev.crossfill.as_dict() if ev.crossfill else None}).body())
                    yield b"data: [DONE]\n\n"
                    return
            raise ValueError("decode stream ended without a result")
        except (httpx.HTTPError, ValueError) as exc:
            ended = True
            gw.metrics.errors.labels("decode_failed").inc()
            err = APIError(502, f"decode stream broke: {type(exc).__name__}: {exc}", code="decode_failed")
            gw.log_request(info, None, err.message, outcome="error" if t_first is None else "error_after_first_token",
                           error_code="decode_failed", span=job.span)
            yield _sse(err.body())
            yield b"data: [DONE]\n\n"
        finally:
            if not ended:
                gw.log_request(info, None, "client closed the stream", outcome="client_closed",
                               error_code="client_closed", span=job.span)
            await shielded(events.aclose())  # type: ignore[attr-defined]

    return app


class ClientGone(Exception):
    """The HTTP client disconnected before its (non-streamed) answer was ready."""


async def until_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await `coro`, cancelling it if the client disconnects (FastAPI does not, outside streams).

    Cancelling closes the stream to decode, which aborts the request and frees its KV everywhere.
    """
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client disconnected from %s before the answer; aborting", request.url.path)
                raise ClientGone()
    finally:
        await cancel_and_wait(task)


def _usage(ev: Done) -> dict[str, int]:
    p, c = ev.usage.prompt_tokens, ev.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _final_body(job: _Job, text: str, token_ids: list[int], ev: Done, info: RouteInfo) -> dict[str, Any]:
    finish = ev.finish_reason
    base: dict[str, Any] = {"id": job.request_id, "object": _object(job.kind, False), "created": job.created,
                            "model": job.model, "usage": _usage(ev), "crossfill": info.as_dict()}
    if job.kind == "chat":
        base["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": finish}]
    else:
        base["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    if job.kind == "generate":
        base["request_id"] = job.request_id
        base["text"] = text
        base["token_ids"] = token_ids
        base["finish_reason"] = finish
    return base


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
