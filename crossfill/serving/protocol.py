"""Messages between the serving processes (control plane, HTTP/JSON) and the route report.

gateway --POST /v1/route--> scheduler            RouteQuery in; a `Route` (crossfill.policy) out
gateway --POST /v1/decode--> decode (NDJSON)     DecodeJob in; DecodeEvent out: routed, delta, done | error
decode  --POST /v1/prefill--> prefill (NDJSON)   PrefillJob in; PrefillEvent out: accepted, alive*,
                                                 first_token, done | error
KV frames travel on the data plane (crossfill.kv), never through these messages.

Every event is a typed message with a `Literal` kind, parsed once where it arrives
(`parse_decode_event`, `parse_prefill_event`), so no reader guesses at dict keys. Jobs carry the
engine's own `SamplingParams` and the policy's own `Route` (pydantic validates the dataclasses),
so there is one definition of each.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter

from crossfill.engine.block_pool import DEFAULT_BLOCK_SIZE
from crossfill.engine.sampling import SamplingParams
from crossfill.policy.routing import Route


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Block size of a route query's prefix hashes: the engine's default, which every worker runs with
# (each publishes its own as `block_size` in /v1/admin/stats; hashes at another size never match).
PREFIX_BLOCK_SIZE = DEFAULT_BLOCK_SIZE
# Prompt blocks a route query names by hash (64k tokens at the default block size of 16): enough
# to tell instances apart, and a bounded cost to send and to match per request.
ROUTE_PREFIX_MAX_BLOCKS = 4096
_BLOCK_HASH = re.compile(r"[0-9a-fA-F]{32}")


def _block_hash(value: str) -> str:
    if not _BLOCK_HASH.fullmatch(value):
        raise ValueError("a block hash is 32 hex characters "
                         "(crossfill.engine.block_pool.prompt_block_hashes)")
    return value.lower()


BlockHash = Annotated[str, AfterValidator(_block_hash)]


class RouteQuery(_Msg):
    request_id: str
    prompt_tokens: int = Field(ge=0)
    prefill_policy: str = "auto"
    tenant_id: str | None = None
    # Decode instances that just failed this request (the gateway is routing it again): avoided
    # while another one can take it, still chosen when it is the only one (it may be back by now).
    avoid_decode: list[str] = Field(default_factory=list)
    request_type: Literal["interactive", "batch"] | None = None  # None: the tenant's default
    # The prompt's full blocks as chain hashes (never tokens or text), for the KV index: in the
    # prefill namespace (tenant id, "" when none) and, only when it differs, in the namespace decode
    # registers imported KV under (crossfill.serving.connector.import_namespace). Both at block
    # size PREFIX_BLOCK_SIZE, the first ROUTE_PREFIX_MAX_BLOCKS blocks.
    prefix_hashes: list[BlockHash] = Field(default_factory=list, max_length=ROUTE_PREFIX_MAX_BLOCKS)
    decode_prefix_hashes: list[BlockHash] | None = Field(default=None, max_length=ROUTE_PREFIX_MAX_BLOCKS)


class Endpoint(_Msg):
    """Where an instance added at run time (not in the config file) is reached: at its own address."""

    role: Literal["prefill", "decode"]
    datacenter: str
    host: str
    port: int = Field(gt=0, lt=65536)
    kv_port: int | None = Field(default=None, gt=0, lt=65536)

    def url(self, scheme: str) -> str:
        """Its base URL; `scheme` comes from the reader's own config (CrossfillConfig.http_scheme),
        never from the message, so a registered instance cannot opt out of mutual TLS."""
        return f"{scheme}://{self.host}:{self.port}"


class DecodeJob(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    route: Route
    tenant_id: str | None = None
    trace_id: str | None = None
    deadline_s: float = 600.0  # whole request, from the moment decode receives it
    # The route's instances that the config file does not list (added through the scheduler's admin API).
    endpoints: dict[str, Endpoint] = Field(default_factory=dict)
    # The scheduler's transfer ticket for this route (crossfill.security.tickets); None when tickets are off.
    ticket: str | None = Field(default=None, max_length=4096)


class PrefillJob(_Msg):
    request_id: str
    cache_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv_host: str  # where to send the KV (decode's KV port, or the WAN emulator in front of it)
    kv_port: int
    decode_instance: str
    tenant_id: str | None = None
    trace_id: str | None = None
    deadline_s: float = 600.0
    # Reuse across the wire: decode already holds the KV of the first `decode_cached_tokens` prompt
    # tokens; `decode_prefix_digest` (crossfill.kv.wire.token_digest of those tokens) lets prefill
    # check the claim. Prefill sends only the rest, or everything when the claim does not hold.
    decode_cached_tokens: int = Field(0, ge=0)
    decode_prefix_digest: str | None = None
    # The route's transfer ticket, passed on by decode; prefill checks it before computing anything.
    ticket: str | None = Field(default=None, max_length=4096)


class RouteInfo(BaseModel):
    """What every response reports about how it was served (the `crossfill` object, M5.10 logs)."""

    model_config = ConfigDict(extra="ignore")

    request_id: str
    route: str = "local"  # local | remote: where the prefill that produced the used KV ran
    prefill_instance: str | None = None
    decode_instance: str | None = None
    cache_id: str | None = None
    transport: str | None = None  # kv_cache.transport that carried the KV (None: colocated)
    kv_raw_bytes: int = 0
    kv_wire_bytes: int = 0
    decode_cached_tokens: int = 0  # prompt tokens decode already held, so they never crossed
    prefill_cached_tokens: int = 0  # prompt tokens prefill took from its own prefix cache
    kv_wire_bytes_saved: int = 0  # estimated wire bytes the decode-held prefix did not need
    timings_ms: dict[str, float] = {}
    retries: int = 0
    degradation_reason: str | None = None
    route_reason: str | None = None  # the routing rule that chose the route (crossfill.policy.decide)
    request_type: str = "interactive"
    trace_id: str | None = None
    tenant_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = self.model_dump()
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
        return cls.model_validate(d)


# --------------------------------------------------------------------------- events


class ErrorEvent(_Msg):
    """An explicit failure; before the first token it also becomes the HTTP status."""

    event: Literal["error"] = "error"
    status: int = 502
    code: str | None = None
    message: str = ""
    param: str | None = None
    retry_after: int | None = None
    crossfill: RouteInfo | None = None


# -- prefill -> decode


class Accepted(_Msg):
    event: Literal["accepted"] = "accepted"
    instance: str
    queue_depth: int = 0


class Alive(_Msg):
    """Heartbeat while the prefill waits or computes, so decode tells busy from dead."""

    event: Literal["alive"] = "alive"


class PrefillResult(_Msg):
    """What prefill knows once it has computed: the first token, timings and what was reused."""

    first_token_id: int
    timings_ms: dict[str, float] = {}
    num_cached_tokens: int = 0  # prefill's own prefix-cache hits
    export_from: int = 0  # first prompt token whose KV was sent (the decode-held prefix was skipped)
    reuse_refused: str | None = None  # why decode's cached-prefix claim was not used (everything sent)


class FirstToken(PrefillResult):
    event: Literal["first_token"] = "first_token"


class KVReport(_Msg):
    """The transfer's cost (crossfill.kv.backend.TransferStats), as the sender measured it."""

    model_config = ConfigDict(extra="ignore")

    frames: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    duration_s: float = 0.0
    commit_wait_s: float = 0.0
    retransmits: int = 0
    reconnects: int = 0
    streams: int = 1


class PrefillDone(PrefillResult):
    event: Literal["done"] = "done"
    kv: KVReport = KVReport()


PrefillEvent = Annotated[Accepted | Alive | FirstToken | PrefillDone | ErrorEvent, Field(discriminator="event")]

# -- decode -> gateway


class Routed(_Msg):
    """KV is in place and decoding starts; carries the final route."""

    event: Literal["routed"] = "routed"
    crossfill: RouteInfo


class Delta(_Msg):
    event: Literal["delta"] = "delta"
    token_ids: list[int] = []
    text: str = ""


class Usage(_Msg):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Done(_Msg):
    event: Literal["done"] = "done"
    finish_reason: str | None = None
    usage: Usage = Usage()
    crossfill: RouteInfo | None = None


DecodeEvent = Annotated[Routed | Delta | Done | ErrorEvent, Field(discriminator="event")]

_prefill_events: TypeAdapter[Any] = TypeAdapter(PrefillEvent)
_decode_events: TypeAdapter[Any] = TypeAdapter(DecodeEvent)


def parse_prefill_event(line: str | bytes) -> Accepted | Alive | FirstToken | PrefillDone | ErrorEvent:
    """One NDJSON line from a prefill stream; raises pydantic.ValidationError on anything else."""
    return _prefill_events.validate_json(line)


def parse_decode_event(line: str | bytes) -> Routed | Delta | Done | ErrorEvent:
    """One NDJSON line from a decode stream; raises pydantic.ValidationError on anything else."""
    return _decode_events.validate_json(line)


def ndjson(event: BaseModel) -> bytes:
    return event.model_dump_json().encode() + b"\n"
