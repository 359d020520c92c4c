"""Routing v1 (MISSION M5.7): which prefill instance and which decode instance serve a request.

`decide` is a pure function of the request, a snapshot of the cluster and the config, so the live
scheduler, the simulator and the unit tests all run exactly this code. It never waits and never
does I/O; everything it knows comes in through `Snapshot`.

The rule: short prompts with local capacity stay local; long prompts go to a remote prefill pool
when the link to it is healthy and the config prefers remote prefill; otherwise local, or an
explicit refusal (429 when queues are full, 503 when nothing healthy exists). `prefill_policy`
lets the caller override: `local_only` never crosses datacenters, `remote_required` fails rather
than staying local, `remote_preferred` goes remote when it can and says why when it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from crossfill.config import InferenceServiceConfig

PrefillPolicy = Literal["auto", "local_only", "remote_preferred", "remote_required"]
PREFILL_POLICIES: tuple[str, ...] = ("auto", "local_only", "remote_preferred", "remote_required")
RouteKind = Literal["local", "remote"]


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    prefill_policy: PrefillPolicy = "auto"
    tenant_id: str | None = None


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

    @property
    def available(self) -> bool:
        return self.healthy and self.ready

    @property
    def has_room(self) -> bool:
        return self.queue_depth < self.capacity


@dataclass(frozen=True)
class LinkState:
    """The link between a remote datacenter and the local one, as the link monitor sees it."""

    datacenter: str
    bandwidth_gbps: float | None = None  # None: not measured yet (the configured value is used)
    latency_ms: float | None = None  # one way
    up: bool = True  # False after failed probes or transfers


@dataclass(frozen=True)
class Snapshot:
    local_datacenter: str
    instances: tuple[InstanceState, ...] = ()
    links: tuple[LinkState, ...] = ()


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


def link_health(link: LinkState | None, config: InferenceServiceConfig) -> tuple[bool, str]:
    """Whether KV may cross this link per `network.min_bandwidth_gbps` / `max_latency_ms`."""
    if link is None:
        return False, "no link to that datacenter"
    if not link.up:
        return False, "link down"
    net = config.network
    if link.bandwidth_gbps is not None and link.bandwidth_gbps < net.min_bandwidth_gbps:
        return False, f"link bandwidth {link.bandwidth_gbps:.3g} Gbit/s < min_bandwidth_gbps {net.min_bandwidth_gbps:g}"
    if link.latency_ms is not None and link.latency_ms > net.max_latency_ms:
        return False, f"link latency {link.latency_ms:.3g} ms > max_latency_ms {net.max_latency_ms:g}"
    return True, "ok"


def _least_loaded(cands: list[InstanceState]) -> InstanceState:
    # Ties break by name so the choice is deterministic (tests and the simulator rely on it).
    return min(cands, key=lambda s: ((s.queue_depth + s.pending) / max(s.capacity, 1), s.queue_depth, s.name))


def decide(request: RouteRequest, snapshot: Snapshot, config: InferenceServiceConfig) -> Route:
    """Pick prefill and decode instances for `request`, or raise NoRoute with an HTTP status."""
    if request.prefill_policy not in PREFILL_POLICIES:
        raise NoRoute(400, "invalid_prefill_policy",
                      f"prefill_policy must be one of {list(PREFILL_POLICIES)}, got {request.prefill_policy!r}")
    local = snapshot.local_datacenter
    decode = _pick_decode(snapshot, config)

    if config.mode == "colocated":
        reason = "mode colocated: the decode instance prefills itself"
        if request.prefill_policy == "remote_required":
            raise NoRoute(503, "no_remote_prefill",
                          "prefill_policy remote_required cannot be served: inference_service.mode is colocated")
        return Route("local", decode.name, decode.name, reason=reason)

    prefills = [s for s in snapshot.instances if s.role == "prefill"]
    local_avail = [s for s in prefills if s.datacenter == local and s.available]
    local_room = [s for s in local_avail if s.has_room]
    links = {lk.datacenter: lk for lk in snapshot.links}
    remote_avail: list[InstanceState] = []
    link_problems: list[str] = []
    for s in prefills:
        if s.datacenter == local or not s.available:
            continue
        ok, why = link_health(links.get(s.datacenter), config)
        if ok:
            remote_avail.append(s)
        else:
            link_problems.append(f"{s.datacenter}: {why}")
    remote_room = [s for s in remote_avail if s.has_room]
    retry_after = None  # filled by the scheduler service from its config

    def remote_why() -> str:
        if remote_avail and not remote_room:
            return "every remote prefill queue is full"
        if link_problems:
            return "; ".join(sorted(set(link_problems)))
        return "no healthy remote prefill instance"

    def local_fallbacks() -> tuple[str, ...]:
        if not config.routing.fallback_to_local_on_failure:
            return ()
        return tuple(s.name for s in sorted(local_avail, key=lambda s: (s.queue_depth, s.name)))

    def remote(reason: str, degraded: str | None = None, allow_local: bool = True) -> Route:
        chosen = _least_loaded(remote_room)
        others = tuple(s.name for s in sorted(remote_room, key=lambda s: (s.queue_depth, s.name)) if s is not chosen)
        fallbacks = others + (local_fallbacks() if allow_local else ())
        return Route("remote", chosen.name, decode.name, fallbacks=fallbacks,
                     degradation_reason=degraded, reason=reason)

    def local_route(reason: str, degraded: str | None = None) -> Route:
        chosen = _least_loaded(local_room)
        others = tuple(s.name for s in sorted(local_room, key=lambda s: (s.queue_depth, s.name)) if s is not chosen)
        return Route("local", chosen.name, decode.name, fallbacks=others, degradation_reason=degraded, reason=reason)

    def refuse_local() -> NoRoute:
        if local_avail:
            return NoRoute(429, "prefill_queue_full", "every local prefill queue is full (max_queue_depth)",
                           retry_after)
        return NoRoute(503, "no_prefill_instance", "no healthy local prefill instance", retry_after)

    policy = request.prefill_policy
    if policy == "local_only":
        if local_room:
            return local_route("prefill_policy local_only")
        raise refuse_local()

    if policy == "remote_required":
        if remote_room:
            # No local fallback: the caller asked for remote prefill only.
            return remote("prefill_policy remote_required", allow_local=False)
        status, code = (429, "prefill_queue_full") if remote_avail else (503, "no_remote_prefill")
        raise NoRoute(status, code, f"prefill_policy remote_required cannot be served: {remote_why()}", retry_after)

    if policy == "remote_preferred":
        if remote_room:
            return remote("prefill_policy remote_preferred")
        if local_room:
            return local_route("prefill_policy remote_preferred", degraded=f"remote unavailable: {remote_why()}")
        raise refuse_local()

    # auto
    threshold = config.routing.long_context_threshold_tokens
    long_prompt = request.prompt_tokens >= threshold
    if long_prompt and config.routing.prefer_remote_prefill:
        if remote_room:
            return remote(f"auto: prompt {request.prompt_tokens} tokens >= long_context_threshold_tokens {threshold}")
        if local_room:
            return local_route("auto: long prompt", degraded=f"remote unavailable: {remote_why()}")
        raise refuse_local()
    if local_room:
        why = (f"auto: prompt {request.prompt_tokens} tokens < long_context_threshold_tokens {threshold}"
               if not long_prompt else "auto: long prompt, prefer_remote_prefill is false")
        return local_route(why)
    # Local prefill is full or down: overflow to a remote pool rather than refuse, and say so.
    if remote_room:
        return remote("auto: local prefill saturated", degraded="local prefill unavailable: overflow to remote")
    raise refuse_local()


def _pick_decode(snapshot: Snapshot, config: InferenceServiceConfig) -> InstanceState:
    decodes = [s for s in snapshot.instances
               if s.role == "decode" and s.datacenter == snapshot.local_datacenter and s.available]
    if not decodes:
        raise NoRoute(503, "no_decode_instance", "no healthy decode instance")
    room = [s for s in decodes if s.has_room]
    if not room:
        raise NoRoute(429, "decode_full",
                      "every decode instance is at max_concurrent_requests "
                      f"({config.decode_pool.max_concurrent_requests})")
    return _least_loaded(room)
