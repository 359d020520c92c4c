"""Metrics read at scrape time from state a service already keeps (nothing is counted twice).

- `EngineCollector` (prefill, decode): the engine's KV blocks, active requests, preemptions;
- `ReceiverCollector` (decode): the KV receiver's accepted/refused counters (`counters()` of the
  backend, keyed `frames_accepted`, `refused_<reason>`, `transfers_failed_<reason>`, ...), so
  checksum failures and refusals show per reason whatever the transport;
- `ClusterCollector` (scheduler): each link's estimates (RTT, bandwidth, loss, retransmits,
  breaker, in-flight and egress bytes, utilisation) and each worker as the scheduler sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crossfill.kv.errors import Reason

_GBIT = 1e9 / 8  # bytes per second in one Gbit/s


class EngineCollector(Collector):
    """`crossfill_engine_*` from the worker's `kv_stats()` ({} while the model loads)."""

    def __init__(self, kv_stats: Callable[[], Mapping[str, int]]) -> None:
        self._kv_stats = kv_stats

    def collect(self) -> Iterator[Metric]:
        s = self._kv_stats()
        blocks = GaugeMetricFamily("crossfill_engine_kv_blocks", "Engine KV cache blocks (total, used, cached: "
                                   "unreferenced but kept for prefix reuse)", labels=["state"])
        active = GaugeMetricFamily("crossfill_engine_active_requests", "Requests in the engine")
        preempt = CounterMetricFamily("crossfill_engine_preemptions", "Requests the engine preempted for KV memory")
        if s:
            for state in ("total", "used", "cached"):
                blocks.add_metric([state], s.get(f"blocks_{state}", 0))
            active.add_metric([], s.get("active_requests", 0))
            preempt.add_metric([], s.get("preemptions", 0))
        yield from (blocks, active, preempt)


# Refusals that mean the bytes were damaged: a frame's checksum, or the commit's digest over them.
_CHECKSUM_REASONS = (Reason.CHECKSUM.label, Reason.COMMIT_DIGEST.label)
# Everything that damaged bytes can cause: the checksums, and a header that no longer parses or
# declares sizes or a codec the manifest does not (corruption of the framing rather than the payload).
_INTEGRITY_REASONS = (*_CHECKSUM_REASONS, Reason.MALFORMED.label, Reason.OVERSIZED.label, Reason.CODEC.label)


class ReceiverCollector(Collector):
    """`crossfill_kv_frames_*`, `crossfill_kv_checksum_failures_total` and friends from the receiver."""

    def __init__(self, counters: Callable[[], Mapping[str, int]]) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        c = dict(self._counters())
        refused = {k.removeprefix("refused_"): v for k, v in c.items() if k.startswith("refused_")}
        frames = CounterMetricFamily("crossfill_kv_frames_received", "KV frames at the receiver (refused: every "
                                     "manifest, frame and commit refusal)", labels=["result"])
        frames.add_metric(["accepted"], c.get("frames_accepted", 0))
        frames.add_metric(["duplicate"], c.get("frames_duplicate", 0))
        frames.add_metric(["refused"], sum(refused.values()))
        by_reason = CounterMetricFamily("crossfill_kv_frames_refused", "Receiver refusals by reason",
                                        labels=["reason"])
        for reason, n in sorted(refused.items()):
            by_reason.add_metric([reason], n)
        checksum = CounterMetricFamily("crossfill_kv_checksum_failures", "KV frames refused for a checksum "
                                       "mismatch plus commits refused for a digest mismatch")
        checksum.add_metric([], sum(refused.get(r, 0) for r in _CHECKSUM_REASONS))
        integrity = CounterMetricFamily("crossfill_kv_integrity_failures", "KV messages refused as damaged: "
                                        "checksum or commit-digest mismatch, unparsable or oversized framing, "
                                        "codec mismatch")
        integrity.add_metric([], sum(refused.get(r, 0) for r in _INTEGRITY_REASONS))
        transfers = CounterMetricFamily("crossfill_kv_receiver_transfers", "Transfers at the receiver",
                                        labels=["result"])
        transfers.add_metric(["expected"], c.get("transfers_expected", 0))
        transfers.add_metric(["completed"], c.get("transfers_completed", 0))
        transfers.add_metric(["failed"], sum(v for k, v in c.items() if k.startswith("transfers_failed_")))
        raw = CounterMetricFamily("crossfill_kv_receiver_events", "Every counter of the KV receiver, by key",
                                  labels=["event"])
        for key, n in sorted(c.items()):
            raw.add_metric([key], n)
        yield from (frames, by_reason, checksum, integrity, transfers, raw)


class _Link(Protocol):
    override_gbps: float | None

    def as_dict(self) -> dict[str, object]: ...


class _Worker(Protocol):
    inst: Any
    state: str
    healthy: bool
    ready: bool
    queue_depth: int
    capacity: int


class ClusterCollector(Collector):
    """The scheduler's picture: `crossfill_link_*{link}` and `crossfill_scheduler_instance_*{worker,...}`.

    `links` maps the remote datacenter to its `LinkWatch`; `workers` the instance name to its
    tracked state; `extra` gives scalar gauges (batch queue depth, live threshold).
    """

    def __init__(self, links: Callable[[], Mapping[str, _Link]], workers: Callable[[], Iterable[_Worker]],
                 extra: Callable[[], Mapping[str, tuple[str, float]]]) -> None:
        self._links, self._workers, self._extra = links, workers, extra

    def collect(self) -> Iterator[Metric]:
        yield from self._link_metrics()
        yield from self._worker_metrics()
        for name, (doc, value) in self._extra().items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g

    def _link_metrics(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["link", *(extra or [])])

        rtt = gauge("crossfill_link_rtt_seconds", "Link round-trip time estimate (absent until measured)")
        bw = gauge("crossfill_link_bandwidth_estimate_bytes_per_second", "Measured link bandwidth (absent until "
                   "measured)")
        cap = gauge("crossfill_link_capacity_bytes_per_second", "Link capacity: the operator's override, else the "
                    "configured bandwidth")
        loss = gauge("crossfill_link_loss_ratio", "KV frames lost / sent over recent transfers")
        retx = gauge("crossfill_link_retransmit_ratio", "KV frames retransmitted / sent over recent transfers")
        up = gauge("crossfill_link_up", "1 when the link answers probes and transfers")
        healthy = gauge("crossfill_link_healthy", "1 when RTT, bandwidth and loss are within the network thresholds")
        usable = gauge("crossfill_link_usable", "1 when routing may send KV over the link")
        breaker = gauge("crossfill_link_breaker_state", "Circuit breaker: 1 on the current state", ["state"])
        flight = gauge("crossfill_link_in_flight_bytes", "KV bytes routed over the link and not reported done")
        egress = gauge("crossfill_link_egress_bytes_per_second", "KV wire bytes per second over the last window")
        util = gauge("crossfill_link_utilization_ratio", "egress bytes per second / capacity")
        for dc, link in sorted(self._links().items()):
            d = link.as_dict()
            if d.get("rtt_ms") is not None:
                rtt.add_metric([dc], float(d["rtt_ms"]) / 1000)  # type: ignore[arg-type]
            measured = d.get("bandwidth_gbps") if link.override_gbps is None else None
            if measured is not None:
                bw.add_metric([dc], float(measured) * _GBIT)  # type: ignore[arg-type]
            capacity = link.override_gbps or d.get("configured_bandwidth_gbps")
            egress_bps = float(d.get("egress_bytes_per_s") or 0.0)  # type: ignore[arg-type]
            if capacity:
                cap.add_metric([dc], float(capacity) * _GBIT)  # type: ignore[arg-type]
                util.add_metric([dc], egress_bps / (float(capacity) * _GBIT))  # type: ignore[arg-type]
            loss.add_metric([dc], float(d.get("loss_rate") or 0.0))  # type: ignore[arg-type]
            retx.add_metric([dc], float(d.get("retransmit_rate") or 0.0))  # type: ignore[arg-type]
            up.add_metric([dc], float(bool(d.get("up"))))
            healthy.add_metric([dc], float(bool(d.get("healthy"))))
            usable.add_metric([dc], float(bool(d.get("usable"))))
            for state in ("closed", "open", "half_open"):
                breaker.add_metric([dc, state], float(d.get("breaker") == state))
            flight.add_metric([dc], float(d.get("in_flight_bytes") or 0))  # type: ignore[arg-type]
            egress.add_metric([dc], egress_bps)
        yield from (rtt, bw, cap, loss, retx, up, healthy, usable, breaker, flight, egress, util)

    def _worker_metrics(self) -> Iterator[Metric]:
        labels = ["worker", "worker_role", "worker_datacenter"]
        up = GaugeMetricFamily("crossfill_scheduler_instance_up", "1 when the scheduler sees the worker healthy, "
                               "ready and active", labels=labels)
        depth = GaugeMetricFamily("crossfill_scheduler_instance_queue_depth", "Worker queue depth at the last probe",
                                  labels=labels)
        cap = GaugeMetricFamily("crossfill_scheduler_instance_capacity", "Worker capacity at the last probe",
                                labels=labels)
        for t in self._workers():
            key = [t.inst.name, t.inst.role, t.inst.datacenter]
            up.add_metric(key, float(t.healthy and t.ready and t.state == "active"))
            depth.add_metric(key, t.queue_depth)
            cap.add_metric(key, t.capacity)
        yield from (up, depth, cap)
