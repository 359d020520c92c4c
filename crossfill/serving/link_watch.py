"""The scheduler's view of one inter-DC link: its monitor plus the KV traffic routed over it.

One `LinkWatch` per link to the local datacenter. The estimates (RTT, bandwidth, loss, health
with hysteresis, circuit breaker) are `crossfill.net.link_monitor.LinkMonitor`'s; this adds what
only the scheduler knows:

- the KV bytes routed over the link and not reported done yet (`in_flight_bytes`), which the
  policy puts ahead of a new request's transfer (congestion back-off). An entry leaves when
  decode reports the transfer, or after `expire_s` (a report that never comes: decode died);
- the KV bytes the link carried in the last `egress_window_s` (`egress_bytes_per_s`), for
  `routing.egress_budget_bytes_per_s`;
- an operator's capacity override (`POST /v1/admin/links/{dc}`), which wins over the estimate.

Its samples come from three places: the health probes of the instances behind the link (small
requests that cross it: RTT and reachability), an active payload probe (`GET /v1/admin/probe`,
`network.bandwidth_probe_bytes` every `bandwidth_probe_interval_s`: bandwidth, even when no
request crosses), and decode's transfer reports (outcome for the breaker, frame counts for loss,
and wire bytes over the transfer's whole duration, a sample that can only be below the link's rate).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from crossfill.config import NetworkConfig
from crossfill.net.link_monitor import LinkMonitor
from crossfill.policy import LinkState


@dataclass
class _Flight:
    nbytes: int
    expires: float


class LinkWatch:
    def __init__(self, datacenter: str, network: NetworkConfig, configured_gbps: float, *,
                 expire_s: float = 60.0, egress_window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.datacenter = datacenter
        # A bandwidth window of several probe intervals: the max filter then needs several probes
        # in a row to be slow before the estimate drops (one busy moment is not a slow link).
        window = max(8.0, 4 * network.bandwidth_probe_interval_s)
        self.monitor = LinkMonitor.from_config(network, configured_bandwidth_gbps=configured_gbps,
                                               bandwidth_window_s=window, clock=clock)
        self.network = network
        self.expire_s, self.egress_window_s = expire_s, egress_window_s
        self.clock = clock
        self.override_gbps: float | None = None
        self._flights: dict[str, _Flight] = {}
        self._egress: deque[tuple[float, int]] = deque()

    # -- traffic ---------------------------------------------------------------------------
    def routed(self, request_id: str, nbytes: int) -> None:
        """A request was routed over the link; its KV (estimated) is in flight until reported."""
        self._flights[request_id] = _Flight(max(nbytes, 0), self.clock() + self.expire_s)

    def transferred(self, request_id: str | None, wire_bytes: int, seconds: float, ok: bool,
                    frames: int = 0, lost: int = 0, retransmitted: int = 0) -> None:
        if request_id is not None:
            self._flights.pop(request_id, None)
        self.monitor.record_transfer(ok, frames=frames, lost=min(lost, frames), retransmitted=retransmitted)
        if ok and wire_bytes > 0:
            self._egress.append((self.clock(), wire_bytes))
            if seconds > 0:
                self.monitor.record_bandwidth(wire_bytes, seconds)

    def in_flight_bytes(self) -> int:
        now = self.clock()
        for rid in [r for r, f in self._flights.items() if f.expires <= now]:
            del self._flights[rid]
        return sum(f.nbytes for f in self._flights.values())

    def egress_bytes_per_s(self) -> float:
        now = self.clock()
        while self._egress and self._egress[0][0] < now - self.egress_window_s:
            self._egress.popleft()
        return sum(n for _, n in self._egress) / self.egress_window_s

    # -- the snapshot the policy sees ---------------------------------------------------------
    def state(self) -> LinkState:
        snap = self.monitor.snapshot()
        healthy, reason = snap.healthy, "; ".join(snap.reasons)
        bandwidth = snap.bandwidth_gbps
        if self.override_gbps is not None:
            bandwidth = self.override_gbps
            if self.override_gbps < self.network.min_bandwidth_gbps:
                healthy = False
                reason = (f"link bandwidth {self.override_gbps:.3g} Gbit/s (set by the admin API) "
                          f"< min_bandwidth_gbps {self.network.min_bandwidth_gbps:g}")
        return LinkState(self.datacenter, bandwidth_gbps=bandwidth, latency_ms=snap.latency_ms, up=snap.up,
                         healthy=healthy, breaker=snap.breaker, reason=reason,
                         configured_bandwidth_gbps=snap.configured_bandwidth_gbps,
                         in_flight_bytes=self.in_flight_bytes(), egress_bytes_per_s=self.egress_bytes_per_s())

    def as_dict(self) -> dict[str, object]:
        state = self.state()
        return {**self.monitor.snapshot().as_dict(), "bandwidth_override_gbps": self.override_gbps,
                "bandwidth_gbps": state.bandwidth_gbps, "healthy": state.healthy,
                "usable": state.up and bool(state.healthy) and state.breaker == "closed",
                "reason": state.reason, "in_flight_bytes": state.in_flight_bytes,
                "egress_bytes_per_s": state.egress_bytes_per_s}
