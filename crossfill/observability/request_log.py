"""The request log (M5.10): one JSON line per request per stage, on logger `crossfill.requests`.

The gateway writes one line per request (what the client got), decode one per decode it ran,
prefill one per prefill it computed. Each line is a whole JSON object (no text prefix, so a log
shipper parses it as is) with the ten M5.10 fields:

    request_id, tenant_id, routing_path (+ route, route_reason), prefill_instance, decode_instance,
    cache_id, durations_ms (per stage), error_code, retry_count, degradation_reason

plus `ts`, `level`, `service`, `instance`, `stage`, `status`, `trace_id` and a few counts (tokens,
KV bytes). Never the prompt or the output text: only ids, names, numbers and error messages,
which crossfill writes without request content (tests/security/test_log_redaction.py).

A finished request is an `info` line, a failed or degraded one a `warning`, so
`observability.log_level` (the level of every process) decides what is written: at `warning`
only the requests that went wrong.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from crossfill.serving.protocol import RouteInfo

LOGGER = "crossfill.requests"
log = logging.getLogger(LOGGER)


class JSONLineFormatter(logging.Formatter):
    """The record's `fields` (set by `RequestLog.emit`) as one JSON object, with time and level."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        body = {"ts": ts, "level": record.levelname.lower(), **getattr(record, "fields", {"message": record.getMessage()})}
        return json.dumps(body, separators=(",", ":"), default=str)


def _install_handler() -> None:
    """A stderr handler that writes bare JSON lines, once per process; records do not reach the
    root handler too (its text prefix would break the line). The level stays the root's."""
    if any(getattr(h, "_crossfill_requests", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONLineFormatter())
    handler._crossfill_requests = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.propagate = False


def routing_path(info: RouteInfo) -> str:
    """Where the request went, as one string: "remote: far-prefill-0 -> here-decode-0"."""
    hops = " -> ".join(h for h in (info.prefill_instance, info.decode_instance) if h)
    return f"{info.route}: {hops}" if hops else "none"


class RequestLog:
    """The request log of one process (`service`: gateway, scheduler or the instance's name)."""

    def __init__(self, service: str, instance: str) -> None:
        self.service, self.instance = service, instance
        _install_handler()

    def emit(self, stage: str, info: RouteInfo, *, status: str, error_code: str | None = None,
             error: str | None = None, **extra: Any) -> None:
        """Write the line for `stage` of `info`'s request. `status`: ok, error, error_after_first_token,
        client_closed; `extra`: counts only (never request content)."""
        fields = {
            "service": self.service, "instance": self.instance, "stage": stage,
            "request_id": info.request_id or None, "tenant_id": info.tenant_id, "status": status,
            "route": info.route if info.decode_instance or info.prefill_instance else None,
            "routing_path": routing_path(info), "route_reason": info.route_reason,
            "prefill_instance": info.prefill_instance, "decode_instance": info.decode_instance,
            "cache_id": info.cache_id,
            "durations_ms": {k: round(v, 1) for k, v in info.timings_ms.items()},
            "error_code": error_code, "error": error, "retry_count": info.retries,
            "degradation_reason": info.degradation_reason, "trace_id": info.trace_id,
            "request_type": info.request_type, **extra,
        }
        level = logging.WARNING if status != "ok" or info.degradation_reason else logging.INFO
        log.log(level, "%s %s %s", stage, info.request_id, status, extra={"fields": fields})
