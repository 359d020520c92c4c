"""Routing (MISSION M4, M5.7): which prefill instance and which decode instance serve a request.

`decide` is a pure function of the request, a snapshot of the cluster and the config, so the live
scheduler, the simulator (`crossfill simulate`) and the unit tests all run exactly this code. It
never waits and never does I/O; everything it knows comes in through `RouteRequest` and `Snapshot`.

The dimensions it weighs, each visible in the route's `reason`:

- *incremental length*: the long-prompt threshold applies to the tokens that neither local
  prefill has cached nor the decode instance already holds (what serving it here would cost);
- *KV already present*: the scheduler's KV index gives each instance's longest cached prefix
  (`RouteRequest.cached_tokens`); instances are ranked by the time they would take, so the one
  holding a conversation's history or a shared system prompt wins, and the decode instance
  holding the prefix is preferred (less to send);
- *bandwidth*: KV crosses only when sending it over the link (at the monitor's estimate, behind
  the bytes already in flight, plus a round trip) takes less time than prefilling locally would;
  a link that moves KV slower per token than local prefill makes it never pays off;
- *link health*: down, unhealthy (the monitor's hysteresis), or circuit breaker not closed;
- *request type and tier*: `batch` requests never take local prefill while a remote pool exists,
  use at most `batch_capacity_share` of a queue, and wait (`Defer`) for spare remote capacity;
  `premium` tenants may use the local share `reserved_premium_share` keeps from the others;
- *short prompts*: never cross under `auto` when local prefill is full (429), unless
  `allow_short_overflow`;
- *cost*: a per-datacenter weight scales the time of the path through it; an egress budget caps
  the KV bytes per second the link may carry.

`prefill_policy` lets the caller override: `local_only` never crosses datacenters,
`remote_required` fails rather than staying local, `remote_preferred` goes remote when it can and
says why when it cannot. The estimates themselves live in `crossfill.policy.estimate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from crossfill.config import InferenceServiceConfig, RequestType
from crossfill.policy.estimate import Estimates, Gate, offload_gate

PrefillPolicy = Literal["auto", "local_only", "remote_preferred", "remote_required"]
PREFILL_POLICIES: tuple[str, ...] = ("auto", "local_only", "remote_preferred", "remote_required")
REQUEST_TYPES: tuple[str, ...] = ("interactive", "batch")
RouteKind = Literal["local", "remote"]
Breaker = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    prefill_policy: PrefillPolicy = "auto"
    tenant_id: str | None = None
    request_type: RequestType | None = None  # None: the tenant's default (interactive)
    # Longest cached prefix of this prompt, in tokens, per instance (prefill: its prefix cache;
    # decode: the KV it holds), from the scheduler's KV index. Missing means nothing cached.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceState:
    """What the scheduler knows about one worker from its last health checks."""

    name: str
    role: Literal["prefill", "decode"]
    datacenter: str
    healthy: bool = True  # answered its recent health checks
    ready: bool = True  # warm and serving (/readyz)
    queue_depth: int = 0  # prefill: requests queued or running; decode: active requests (last probe)
    capacity: int = 1  # prefill: max_queue_depth; decode: max_concurrent_requests
    # Requests routed to it since that probe. They spread load between probes but do not refuse:
    # most have finished already, and the instance enforces its own limit with a 429.
    pending: int = 0
    prefill_tokens_per_s: float | None = None  # measured; None: routing.assumed_prefill_tokens_per_s

    @property
    def available(self) -> bool:
        return self.healthy and self.ready

    @property
    def has_room(self) -> bool:
        return self.queue_depth < self.capacity

    @property
    def load(self) -> float:
        return (self.queue_depth + self.pending) / max(self.capacity, 1)


@dataclass(frozen=True)
class LinkState:
    """The link between a remote datacenter and the local one, as the link monitor sees it."""

    datacenter: str
    bandwidth_gbps: float | None = None  # estimate; None: not measured yet (configured value used)
    latency_ms: float | None = None  # one way
    up: bool = True  # False after failed probes
    # The monitor's verdict with hysteresis. None: no monitor (tests, simulator): the policy
    # applies network.min_bandwidth_gbps / max_latency_ms to the numbers above itself.
    healthy: bool | None = None
    breaker: Breaker = "closed"
    reason: str = ""  # why not healthy, from the monitor
    configured_bandwidth_gbps: float | None = None
    in_flight_bytes: int = 0  # KV routed over this link and not reported done yet
    egress_bytes_per_s: float = 0.0  # KV it carried recently


@dataclass(frozen=True)
class Snapshot:
    local_datacenter: str
    instances: tuple[InstanceState, ...] = ()
    links: tuple[LinkState, ...] = ()
    # Wire bytes per prompt token (after codec and window pruning), measured on transfers.
    kv_bytes_per_token: float | None = None
    # The live long-prompt threshold the scheduler re-tuned (None or pin_threshold: the config's).
    threshold_tokens: int | None = None


@dataclass(frozen=True)
class Route:
    kind: RouteKind
    prefill: str  # instance name (the decode instance itself in colocated mode)
    decode: str
    # Tried, in order, when the chosen prefill fails (fallback_to_local_on_failure).
    fallbacks: tuple[str, ...] = ()
    # Why the route is not what the request or the rule would normally get (never silent).
    degradation_reason: str | None = None
    reason: str = ""  # the rule that picked it, for logs and route info
    request_type: RequestType = "interactive"
    prefill_cached_tokens: int = 0  # of the prompt, in the chosen prefill's prefix cache
    decode_held_tokens: int = 0  # of the prompt, already held by the chosen decode instance


@dataclass
class NoRoute(Exception):
    """No instance can take the request now. `status` is the HTTP status the gateway returns."""

    status: int
    code: str
    message: str
    retry_after_s: int | None = None
    details: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


class Defer(NoRoute):
    """A batch request waits in the scheduler's batch queue for spare capacity (not an error yet)."""

    def __init__(self, message: str) -> None:
        super().__init__(429, "batch_deferred", message)


def link_health(link: LinkState | None, config: InferenceServiceConfig) -> tuple[bool, str]:
    """Whether KV may cross this link now, and why not."""
    if link is None:
        return False, "no link to that datacenter"
    if not link.up:
        return False, "link down"
    if link.breaker != "closed":
        return False, f"circuit breaker {link.breaker.replace('_', '-')} after repeated transfer failures"
    if link.healthy is not None:
        return (True, "ok") if link.healthy else (False, link.reason or "link unhealthy")
    net = config.network
    if link.bandwidth_gbps is not None and link.bandwidth_gbps < net.min_bandwidth_gbps:
        return False, f"link bandwidth {link.bandwidth_gbps:.3g} Gbit/s < min_bandwidth_gbps {net.min_bandwidth_gbps:g}"
    if link.latency_ms is not None and link.latency_ms > net.max_latency_ms:
        return False, f"link latency {link.latency_ms:.3g} ms > max_latency_ms {net.max_latency_ms:g}"
    return True, "ok"


def decide(request: RouteRequest, snapshot: Snapshot, config: InferenceServiceConfig) -> Route:
    """Pick prefill and decode instances for `request`, or raise NoRoute (Defer for batch waits)."""
    if request.prefill_policy not in PREFILL_POLICIES:
        raise NoRoute(400, "invalid_prefill_policy",
                      f"prefill_policy must be one of {list(PREFILL_POLICIES)}, got {request.prefill_policy!r}")
    tenant = config.routing.tenant(request.tenant_id)
    rtype = request.request_type or tenant.request_type
    if rtype not in REQUEST_TYPES:
        raise NoRoute(400, "invalid_request_type",
                      f"request_type must be one of {list(REQUEST_TYPES)}, got {rtype!r}")
    return _Decision(request, snapshot, config, rtype).run()


class _Decision:
    """One call of `decide`: the candidate sets, then the rules in order."""

    def __init__(self, request: RouteRequest, snapshot: Snapshot, config: InferenceServiceConfig,
                 rtype: RequestType) -> None:
        self.req, self.snap, self.cfg, self.rtype = request, snapshot, config, rtype
        self.routing = config.routing
        self.batch = rtype == "batch"
        self.premium = self.routing.tenant(request.tenant_id).tier == "premium"
        self.local = snapshot.local_datacenter
        self.decode = self._pick_decode()
        self.held = self.cached(self.decode.name)
        self.links = {lk.datacenter: lk for lk in snapshot.links}

        prefills = [s for s in snapshot.instances if s.role == "prefill"]
        self.local_avail = [s for s in prefills if s.datacenter == self.local and s.available]
        self.local_room = [s for s in self.local_avail if self._room(s, local=True)]
        self.remote_exists = any(s.datacenter != self.local for s in prefills)
        self.remote_avail: list[InstanceState] = []
        self.link_problems: list[str] = []
        for s in prefills:
            if s.datacenter == self.local or not s.available:
                continue
            ok, why = link_health(self.links.get(s.datacenter), config)
            if ok:
                self.remote_avail.append(s)
            else:
                self.link_problems.append(f"{s.datacenter}: {why}")
        self.remote_room = [s for s in self.remote_avail if self._room(s, local=False)]
        self.est = Estimates(snapshot, config, request.prompt_tokens, self.held)

    # -- helpers ---------------------------------------------------------------------------
    def cached(self, name: str) -> int:
        return max(0, min(int(self.req.cached_tokens.get(name, 0)), self.req.prompt_tokens))

    def _room(self, s: InstanceState, *, local: bool) -> bool:
        if self.batch:
            # Batch leaves the rest of the queue to interactive requests, and counts what was
            # routed since the last probe: it must never be what fills a queue.
            return s.queue_depth + s.pending < int(s.capacity * self.routing.batch_capacity_share)
        if local and not self.premium and self.routing.reserved_premium_share > 0:
            return s.queue_depth < s.capacity * (1 - self.routing.reserved_premium_share)
        return s.has_room

    def _ranked(self, cands: list[InstanceState]) -> list[InstanceState]:
        # Fastest estimated finish first (queue, uncached compute, transfer, cost weight); ties by
        # load then name, so the choice is deterministic (tests and the simulator rely on it).
        return sorted(cands, key=lambda s: (self.est.path_seconds(s, self.cached(s.name)), s.load, s.name))

    def _remote_why(self) -> str:
        if self.remote_avail and not self.remote_room:
            return ("no remote prefill has batch room (batch_capacity_share)" if self.batch
                    else "every remote prefill queue is full")
        if self.link_problems:
            return "; ".join(sorted(set(self.link_problems)))
        return "no healthy remote prefill instance"

    def _local_fallbacks(self) -> tuple[str, ...]:
        if not self.routing.fallback_to_local_on_failure or (self.batch and self.remote_exists):
            return ()
        return tuple(s.name for s in self._ranked(self.local_avail))

    def _route(self, kind: RouteKind, pool: list[InstanceState], reason: str, degraded: str | None = None,
               allow_local_fallback: bool = True) -> Route:
        ranked = self._ranked(pool)
        chosen = ranked[0]
        fallbacks = tuple(s.name for s in ranked[1:])
        if kind == "remote" and allow_local_fallback:
            fallbacks += self._local_fallbacks()
        return Route(kind, chosen.name, self.decode.name, fallbacks=fallbacks, degradation_reason=degraded,
                     reason=reason, request_type=self.rtype, prefill_cached_tokens=self.cached(chosen.name),
                     decode_held_tokens=self.held)

    def _refuse_local(self) -> NoRoute:
        if self.local_avail:
            return NoRoute(429, "prefill_queue_full", "every local prefill queue is full (max_queue_depth)")
        return NoRoute(503, "no_prefill_instance", "no healthy local prefill instance")

    def _gate(self) -> Gate:
        return offload_gate(self.est, self.local_room or self.local_avail, self.remote_room,
                            [self.cached(s.name) for s in self.local_room or self.local_avail],
                            [self.cached(s.name) for s in self.remote_room])

    # -- the rules -------------------------------------------------------------------------
    def run(self) -> Route:
        if self.cfg.mode == "colocated":
            if self.req.prefill_policy == "remote_required":
                raise NoRoute(503, "no_remote_prefill",
                              "prefill_policy remote_required cannot be served: inference_service.mode is colocated")
            return Route("local", self.decode.name, self.decode.name, request_type=self.rtype,
                         reason="mode colocated: the decode instance prefills itself",
                         decode_held_tokens=self.held)
        if self.batch:
            return self._batch()
        policy = self.req.prefill_policy
        if policy == "local_only":
            if self.local_room:
                return self._route("local", self.local_room, "prefill_policy local_only")
            raise self._refuse_local()
        if policy == "remote_required":
            if self.remote_room:
                # No local fallback: the caller asked for remote prefill only.
                return self._route("remote", self.remote_room, "prefill_policy remote_required",
                                   allow_local_fallback=False)
            status, code = (429, "prefill_queue_full") if self.remote_avail else (503, "no_remote_prefill")
            raise NoRoute(status, code, f"prefill_policy remote_required cannot be served: {self._remote_why()}")
        if policy == "remote_preferred":
            if self.remote_room:
                return self._route("remote", self.remote_room, "prefill_policy remote_preferred")
            if self.local_room:
                return self._route("local", self.local_room, "prefill_policy remote_preferred",
                                   degraded=f"remote unavailable: {self._remote_why()}")
            raise self._refuse_local()
        return self._auto()

    def _auto(self) -> Route:
        threshold = self.est.threshold
        incremental = self.est.incremental(self.local_avail, self.cached)
        long_prompt = incremental >= threshold
        size = (f"{incremental} uncached tokens ({self.req.prompt_tokens} in the prompt)"
                if incremental != self.req.prompt_tokens else f"prompt {incremental} tokens")
        if long_prompt and self.routing.prefer_remote_prefill:
            if self.remote_room:
                gate = self._gate()
                if gate.offload:
                    return self._route("remote", self.remote_room,
                                       f"auto: {size} >= threshold {threshold}; {gate.why}")
                if self.local_room:
                    return self._route("local", self.local_room, f"auto: {size} >= threshold {threshold} "
                                       f"but kept local: {gate.why}")
                return self._route("remote", self.remote_room, f"auto: {size} >= threshold {threshold}; "
                                   f"local prefill is full, so remote despite: {gate.why}")
            if self.local_room:
                return self._route("local", self.local_room, "auto: long prompt",
                                   degraded=f"remote unavailable: {self._remote_why()}")
            raise self._refuse_local()
        if self.local_room:
            why = (f"auto: {size} < threshold {threshold}" if not long_prompt
                   else "auto: long prompt, prefer_remote_prefill is false")
            return self._route("local", self.local_room, why)
        # Local prefill is full or down. A short prompt is TTFT-sensitive: crossing a datacenter
        # would cost it more than waiting, so it is refused unless the config allows overflow.
        if self.remote_room and (long_prompt or self.routing.allow_short_overflow):
            return self._route("remote", self.remote_room, "auto: local prefill saturated",
                               degraded="local prefill unavailable: overflow to remote")
        err = self._refuse_local()
        if self.remote_room and not long_prompt:
            err.message += ("; short prompts do not overflow to a remote datacenter "
                            "(routing.allow_short_overflow is false)")
        raise err

    def _batch(self) -> Route:
        policy = self.req.prefill_policy
        if policy != "local_only" and self.remote_room:
            gate = self.est.egress_gate(self.remote_room)
            if gate.offload:
                return self._route("remote", self.remote_room,
                                   f"batch: spare remote capacity (prefill_policy {policy})")
            raise Defer(f"batch request waits: {gate.why}")
        if policy == "remote_required" and not self.remote_exists:
            raise NoRoute(503, "no_remote_prefill", "prefill_policy remote_required cannot be served: "
                          "no remote prefill pool in the topology")
        # Local prefill only when no remote pool exists, or the caller said local_only.
        if (policy == "local_only" or not self.remote_exists) and self.local_room:
            return self._route("local", self.local_room, "batch: spare local capacity (batch_capacity_share)")
        if not self.local_avail and (policy == "local_only" or not self.remote_exists):
            raise NoRoute(503, "no_prefill_instance", "no healthy local prefill instance")
        where = "local" if policy == "local_only" or not self.remote_exists else "remote"
        why = self._remote_why() if where == "remote" else "local prefill has no batch room"
        raise Defer(f"batch request waits for spare {where} prefill capacity: {why}")

    def _pick_decode(self) -> InstanceState:
        decodes = [s for s in self.snap.instances
                   if s.role == "decode" and s.datacenter == self.snap.local_datacenter and s.available]
        if not decodes:
            raise NoRoute(503, "no_decode_instance", "no healthy decode instance")
        room = [s for s in decodes if s.has_room]
        if not room:
            raise NoRoute(429, "decode_full",
                          "every decode instance is at max_concurrent_requests "
                          f"({self.cfg.decode_pool.max_concurrent_requests})")
        # The decode instance holding the longest prefix needs the least KV sent, unless it is
        # clearly busier: held share of the prompt counts against half of its load.
        prompt = max(self.req.prompt_tokens, 1)
        return min(room, key=lambda s: (s.load - 0.5 * self.cached(s.name) / prompt, s.queue_depth, s.name))
