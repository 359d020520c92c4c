"""Routing policy: pure functions of a cluster snapshot, shared by the scheduler and the simulator."""

from crossfill.policy.routing import (
    PREFILL_POLICIES,
    REQUEST_TYPES,
    Defer,
    InstanceState,
    LinkState,
    NoRoute,
    Route,
    RouteRequest,
    Snapshot,
    decide,
    link_health,
)

__all__ = [
    "PREFILL_POLICIES",
    "REQUEST_TYPES",
    "Defer",
    "InstanceState",
    "LinkState",
    "NoRoute",
    "Route",
    "RouteRequest",
    "Snapshot",
    "decide",
    "link_health",
]
