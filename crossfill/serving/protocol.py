"""Messages between the serving processes (control plane, HTTP/JSON) and the route report.

gateway --POST /v1/route--> scheduler            RouteAnswer
gateway --POST /v1/decode--> decode (NDJSON)     DecodeJob in; events "routed", "delta", "done", "error" out
decode  --POST /v1/prefill--> prefill (NDJSON)   PrefillJob in; events "accepted", "alive", "done", "error" out
KV frames travel on the data plane (crossfill.kv), never through these messages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingMsg(_Msg):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False


class RouteQuery(_Msg):
    request_id: str
    prompt_tokens: int = Field(ge=0)
    prefill_policy: str = "auto"
    tenant_id: str | None = None


class RouteMsg(_Msg):
    kind: str  # "local" | "remote"
    prefill: str
    decode: str
    fallbacks: list[str] = []
    degradation_reason: str | None = None
    reason: str = ""


class DecodeJob(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingMsg
    route: RouteMsg
    tenant_id: str | None = None
    trace_id: str | None = None
    deadline_s: float = 600.0  # whole request, from the moment decode receives it


class PrefillJob(_Msg):
    request_id: str
    cache_id: str
    prompt_token_ids: list[int]
    sampling: SamplingMsg
    kv_host: str  # where to send the KV (decode's KV port, or the WAN emulator in front of it)
    kv_port: int
    decode_instance: str
    tenant_id: str | None = None
    trace_id: str | None = None
    deadline_s: float = 600.0


@dataclass
class RouteInfo:
    """What every response reports about how it was served (the `crossfill` object, M5.10 logs)."""

    request_id: str
    route: str = "local"  # local | remote: where the prefill that produced the used KV ran
    prefill_instance: str | None = None
    decode_instance: str | None = None
    cache_id: str | None = None
    kv_raw_bytes: int = 0
    kv_wire_bytes: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    retries: int = 0
    degradation_reason: str | None = None
    trace_id: str | None = None
    tenant_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["timings_ms"] = {k: round(v, 2) for k, v in self.timings_ms.items()}
        return d

    def header(self) -> str:
        """The compact `x-crossfill-route` header value (JSON; the body has the same fields)."""
        return json.dumps(
            {
                "route": self.route,
                "prefill": self.prefill_instance,
                "decode": self.decode_instance,
                "cache_id": self.cache_id,
                "retries": self.retries,
                "degradation_reason": self.degradation_reason,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouteInfo:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def ndjson(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()
