"""OpenTelemetry tracing: one trace per request across gateway, scheduler, decode and prefill.

Every process builds one `Tracing` from `inference_service.observability`: `tracing_enabled`
turns it on, `otlp_endpoint` adds an OTLP/HTTP exporter (a collector: Jaeger, Tempo, the
OpenTelemetry Collector), `trace_file` a JSON-lines file per process (`<stem>.<instance><suffix>`,
one span per line in the SDK's own JSON form). With neither, spans are made and dropped, but the
context still travels, so a collector can be added to any one service without touching the others.

Contexts are passed explicitly, never through the ambient OpenTelemetry context (requests hop
between tasks and async generators): an HTTP hop carries W3C `traceparent` (`headers(ctx)` on the
caller, `extract(request.headers)` on the callee, both with the SDK's TraceContext propagator),
and the KV manifest carries the sender's `kv.send` span as `traceparent`, so decode's import span
joins the trace of the request whose KV it is.

The request's `trace_id` is honoured: when the client sends one of 32 hex digits it becomes the
trace id (`start_root`); otherwise the trace id is new and the gateway reports it as `trace_id`.

Spans carry ids, counts, byte sizes, instance names, reasons and error codes: never prompt or
output text. Buffered spans are written out by `shutdown()`, which every service calls when it
stops (SIGTERM from `crossfill up`), and at interpreter exit otherwise.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from crossfill.config import CrossfillConfig, ObservabilityConfig

__all__ = ["ManifestWatch", "SpanKind", "Tracing", "end_span", "fail_span", "perf_to_ns", "trace_file_path"]

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent/tracestate, whatever OTEL_PROPAGATORS says
_HEX32 = re.compile(r"[0-9a-fA-F]{32}")
_WANTED_TRACE_ID: ContextVar[int | None] = ContextVar("crossfill_wanted_trace_id", default=None)
_NO_PARENT = Context()  # an empty context: the span starts a trace (never the ambient context's span)

Attributes = Mapping[str, str | int | float | bool | None]


class _ClientTraceIds(RandomIdGenerator):
    """A new trace takes the id the request asked for (`start_root` sets it), else a random one."""

    def generate_trace_id(self) -> int:
        wanted = _WANTED_TRACE_ID.get()
        return wanted if wanted is not None else super().generate_trace_id()


class JsonLinesSpanExporter(ConsoleSpanExporter):
    """The SDK's console exporter writing one compact JSON object per span and line, appended to a file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        super().__init__(out=self._file, formatter=lambda span: span.to_json(indent=None) + "\n")

    def shutdown(self) -> None:
        self._file.close()


def trace_file_path(trace_file: str, instance: str) -> Path:
    """Where `instance` writes its spans: `traces.jsonl` -> `traces.<instance>.jsonl` (one file per
    process, so no two processes append to one file)."""
    p = Path(trace_file).expanduser()
    return p.with_name(f"{p.stem}.{instance}{p.suffix}")


def otlp_traces_url(endpoint: str) -> str:
    """The collector's traces URL: `/v1/traces` under a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT means it."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def _exporters(obs: ObservabilityConfig, instance: str) -> list[SpanExporter]:
    out: list[SpanExporter] = []
    if obs.otlp_endpoint:
        # Imported only when configured: it pulls in protobuf and requests.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        out.append(OTLPSpanExporter(endpoint=otlp_traces_url(obs.otlp_endpoint), timeout=5))
    if obs.trace_file:
        out.append(JsonLinesSpanExporter(trace_file_path(obs.trace_file, instance)))
    return out


def client_trace_id(value: str | None) -> int | None:
    """A request's `trace_id` as an OpenTelemetry trace id, when it is one: 32 hex digits, not all zero."""
    if value is None or not _HEX32.fullmatch(value):
        return None
    return int(value, 16) or None


def perf_to_ns(t: float) -> int:
    """A time.perf_counter() reading as wall-clock nanoseconds: the stage timings the services keep
    become span bounds that line up with live spans (and with other processes on the machine)."""
    return time.time_ns() - int((time.perf_counter() - t) * 1e9)


def fail_span(span: Span, code: str, detail: str | None = None) -> None:
    """Mark `span` failed with a short error code (`error.type`) and, optionally, crossfill's reason."""
    span.set_attribute("error.type", code)
    if detail:
        span.set_attribute("crossfill.error", detail[:300])
    span.set_status(Status(StatusCode.ERROR, code))


def end_span(span: Span, attributes: Attributes | None = None, *, error: str | None = None,
             detail: str | None = None) -> None:
    """End `span` once with its outcome: a second call, or a span of disabled tracing, does nothing."""
    if not span.is_recording():
        return
    for key, value in (attributes or {}).items():
        if value is not None:
            span.set_attribute(key, value)
    if error is not None:
        fail_span(span, error, detail)
    span.end()


class ManifestWatch:
    """Decode's manifest check for one transfer, wrapped: after the real check (the transfer ticket,
    if any) accepts the first manifest, note when it came and the sender's `traceparent`, so the
    import span starts at the manifest and hangs under the sender's `kv.send` span."""

    def __init__(self, check: Callable[[Any], None] | None) -> None:
        self.check = check
        self.arrived_ns: int | None = None
        self.traceparent: str | None = None

    def __call__(self, manifest: Any) -> None:
        if self.check is not None:
            self.check(manifest)  # a refused manifest (forged, replayed) tells us nothing
        if self.arrived_ns is None:
            self.arrived_ns = time.time_ns()
            self.traceparent = getattr(manifest, "traceparent", None)


class Tracing:
    """One process's tracer, exporters and W3C propagation (a no-op tracer when tracing is off)."""

    def __init__(self, cfg: CrossfillConfig, role: str, instance: str, datacenter: str) -> None:
        obs = cfg.inference_service.observability
        self.enabled = obs.tracing_enabled
        self._provider: TracerProvider | None = None
        if not self.enabled:
            self.tracer: Tracer = trace.NoOpTracer()
            return
        resource = Resource.create({"service.name": f"crossfill-{role}", "service.namespace": "crossfill",
                                    "service.instance.id": instance, "crossfill.datacenter": datacenter})
        self._provider = TracerProvider(resource=resource, id_generator=_ClientTraceIds())
        for exporter in _exporters(obs, instance):
            self._provider.add_span_processor(BatchSpanProcessor(exporter))  # exports off the event loop
        self.tracer = self._provider.get_tracer("crossfill")

    @classmethod
    def off(cls) -> Tracing:
        """Tracing that does nothing (for parts built without a service's tracing)."""
        self = cls.__new__(cls)
        self.enabled, self._provider, self.tracer = False, None, trace.NoOpTracer()
        return self

    # -- propagation --------------------------------------------------------------------------
    def extract(self, headers: Mapping[str, str]) -> Context | None:
        """The caller's context from W3C `traceparent` in `headers`; None without a valid one (or when off)."""
        if not self.enabled:
            return None
        ctx = _PROPAGATOR.extract(headers)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    @staticmethod
    def headers(ctx: Context | None) -> dict[str, str]:
        """`traceparent` (and `tracestate`) for an HTTP call made within `ctx`; {} without one."""
        out: dict[str, str] = {}
        if ctx is not None:
            _PROPAGATOR.inject(out, context=ctx)
        return out

    @staticmethod
    def traceparent(span: Span) -> str | None:
        """`span` as a W3C traceparent value (what the KV manifest carries); None for a disabled span."""
        return Tracing.headers(Tracing.context(span)).get("traceparent")

    def from_traceparent(self, value: str | None) -> Context | None:
        return self.extract({"traceparent": value}) if value else None

    # -- spans --------------------------------------------------------------------------------
    @staticmethod
    def context(span: Span) -> Context:
        """A context whose current span is `span`: the parent of its children, what headers() carries."""
        return trace.set_span_in_context(span, Context())

    def start(self, name: str, parent: Context | None, *, kind: SpanKind = SpanKind.INTERNAL,
              attributes: Attributes | None = None, start_ns: int | None = None) -> Span:
        """A live span under `parent` (a new trace when None); end it with `end_span`."""
        attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
        return self.tracer.start_span(name, context=parent or _NO_PARENT, kind=kind, attributes=attrs,
                                      start_time=start_ns)

    def start_root(self, name: str, *, headers: Mapping[str, str], trace_id: str | None,
                   attributes: Attributes | None = None, start_ns: int | None = None) -> Span:
        """The request's root span. A `trace_id` of 32 hex digits becomes the trace id; without one,
        a client's `traceparent` header makes this span its child; otherwise a new trace starts."""
        wanted = client_trace_id(trace_id)
        parent = None if wanted is not None else self.extract(headers)
        token = _WANTED_TRACE_ID.set(wanted)
        try:
            return self.start(name, parent, kind=SpanKind.SERVER, attributes=attributes, start_ns=start_ns)
        finally:
            _WANTED_TRACE_ID.reset(token)

    def record(self, name: str, parent: Context | None, start: float, end: float,
               attributes: Attributes | None = None, *, kind: SpanKind = SpanKind.INTERNAL,
               error: str | None = None) -> None:
        """A span placed after the fact between two time.perf_counter() readings: a stage whose
        bounds are known only once it is over (queueing, compute, first token)."""
        span = self.start(name, parent, kind=kind, attributes=attributes, start_ns=perf_to_ns(start))
        if error is not None:
            fail_span(span, error)
        span.end(end_time=perf_to_ns(end))

    @staticmethod
    def trace_id(span: Span) -> str | None:
        """The span's trace id as 32 lowercase hex digits; None when tracing is off."""
        ctx = span.get_span_context()
        return format_trace_id(ctx.trace_id) if ctx.is_valid else None

    def shutdown(self) -> None:
        """Write out every buffered span and close the exporters (idempotent)."""
        provider, self._provider = self._provider, None
        if provider is not None:
            provider.shutdown()

