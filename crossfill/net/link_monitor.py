"""Link monitor: moving estimates of a link's bandwidth, round-trip time and loss, for the scheduler.

The scheduler decides "remote prefill or not" from a snapshot of the link (M5.7, M5.4: monitor
utilisation, loss, retransmits, latency). Configured numbers say what the link should do; this says
what it did recently, from evidence the system produces anyway:

- `record_transfer(bytes, seconds)`: goodput of a real KV transfer. Small transfers measure latency
  rather than bandwidth, so those under `min_transfer_bytes` are not used for the bandwidth estimate.
- `record_rtt(seconds)`: a round trip from a probe (see `crossfill.net.probe`) or a transfer ack.
- `record_loss(lost, sent)` and `record_retransmit(retransmitted, sent)`: counts from the transfer
  layer (refused or missing frames, retransmitted frames) or an emulator's counters.
- `record_failure()`: a probe or transfer that failed outright; `failures_to_down` in a row mark the
  link down until the next success.

Estimates are exponentially weighted moving averages (EWMA): cheap, no windows to size, and weight
`alpha` on the newest sample lets the scheduler react to a degraded link within a few samples. RTT
keeps TCP's smoothing (alpha 1/8) and also the minimum seen, which approximates propagation delay.

`snapshot().healthy` applies the seed config's thresholds the same way the routing policy does:
bandwidth_gbps >= network.min_bandwidth_gbps and one-way latency (RTT / 2) <= network.max_latency_ms;
an unmeasured quantity does not make the link unhealthy (the configured link is trusted until
evidence arrives), a link that is down always does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSnapshot:
    """What the link did recently. None = no sample yet."""

    bandwidth_bps: float | None
    rtt_ms: float | None
    min_rtt_ms: float | None
    loss_rate: float
    retransmit_rate: float
    samples: int  # transfers used for the bandwidth estimate
    rtt_samples: int
    up: bool
    healthy: bool
    reasons: tuple[str, ...]  # why not healthy; empty when healthy
    age_s: float | None  # seconds since the newest sample of any kind

    @property
    def bandwidth_gbps(self) -> float | None:
        return None if self.bandwidth_bps is None else self.bandwidth_bps / 1e9

    @property
    def latency_ms(self) -> float | None:
        """One-way latency estimate (RTT / 2), the quantity `network.max_latency_ms` bounds."""
        return None if self.rtt_ms is None else self.rtt_ms / 2


class _Ewma:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class LinkMonitor:
    """Thread-safe estimator of one link; feed it samples, read `snapshot()`.

    Args:
        min_bandwidth_gbps / max_latency_ms: thresholds of `healthy` (config `network` block).
        max_loss_rate: loss rate above which the link is unhealthy.
        alpha: EWMA weight of the newest bandwidth / loss sample.
        min_transfer_bytes: smaller transfers are ignored for bandwidth (they measure latency).
        failures_to_down: consecutive failures that mark the link down.
        stale_after_s: a bandwidth/RTT estimate older than this is dropped from the snapshot, so an
            idle link falls back to its configured numbers instead of a stale measurement.
    """

    def __init__(
        self,
        min_bandwidth_gbps: float = 40.0,
        max_latency_ms: float = 10.0,
        max_loss_rate: float = 0.01,
        alpha: float = 0.3,
        min_transfer_bytes: int = 256 * 1024,
        failures_to_down: int = 3,
        stale_after_s: float | None = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if failures_to_down < 1:
            raise ValueError(f"failures_to_down must be >= 1, got {failures_to_down}")
        self.min_bandwidth_gbps = min_bandwidth_gbps
        self.max_latency_ms = max_latency_ms
        self.max_loss_rate = max_loss_rate
        self.min_transfer_bytes = min_transfer_bytes
        self.failures_to_down = failures_to_down
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._bw = _Ewma(alpha)
        self._rtt = _Ewma(1 / 8)  # TCP's SRTT gain (RFC 6298)
        self._loss = _Ewma(alpha)
        self._retx = _Ewma(alpha)
        self._min_rtt: float | None = None
        self._samples = 0
        self._rtt_samples = 0
        self._failures = 0
        self._last_bw: float | None = None
        self._last_rtt: float | None = None
        self._last_any: float | None = None

    @classmethod
    def from_config(cls, network: object, **kwargs: object) -> LinkMonitor:
        """Build from the config's `inference_service.network` block (anything with the two fields)."""
        return cls(
            min_bandwidth_gbps=network.min_bandwidth_gbps,  # type: ignore[attr-defined]
            max_latency_ms=network.max_latency_ms,  # type: ignore[attr-defined]
            **kwargs,  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------------ samples

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        """A completed transfer of `nbytes` that took `seconds` (first byte sent to last acked)."""
        if nbytes < 0 or seconds <= 0:
            raise ValueError(f"record_transfer needs nbytes >= 0 and seconds > 0, got {nbytes}, {seconds}")
        with self._lock:
            now = self._success()
            if nbytes >= self.min_transfer_bytes:
                self._bw.add(nbytes * 8 / seconds)
                self._samples += 1
                self._last_bw = now

    def record_rtt(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"record_rtt needs seconds >= 0, got {seconds}")
        with self._lock:
            now = self._success()
            self._rtt.add(seconds)
            self._min_rtt = seconds if self._min_rtt is None else min(self._min_rtt, seconds)
            self._rtt_samples += 1
            self._last_rtt = now

    def record_loss(self, lost: int, sent: int) -> None:
        """`lost` of `sent` units (segments, frames) were lost in one observation period."""
        with self._lock:
            self._loss.add(_fraction("record_loss", lost, sent))
            self._last_any = self._clock()

    def record_retransmit(self, retransmitted: int, sent: int) -> None:
        """`retransmitted` of `sent` units had to be sent again in one observation period."""
        with self._lock:
            self._retx.add(_fraction("record_retransmit", retransmitted, sent))
            self._last_any = self._clock()

    def record_failure(self) -> None:
        """A probe or transfer that failed outright (refused, timed out, cut)."""
        with self._lock:
            self._failures += 1
            self._last_any = self._clock()

    # ------------------------------------------------------------------ reading

    def snapshot(self) -> LinkSnapshot:
        with self._lock:
            now = self._clock()
            bw = self._bw.value if self._fresh(self._last_bw, now) else None
            rtt = self._rtt.value if self._fresh(self._last_rtt, now) else None
            up = self._failures < self.failures_to_down
            loss = self._loss.value or 0.0
            retx = self._retx.value or 0.0
            reasons = []
            if not up:
                reasons.append(f"link down: {self._failures} failures in a row")
            if bw is not None and bw / 1e9 < self.min_bandwidth_gbps:
                reasons.append(
                    f"bandwidth {bw / 1e9:.3g} Gbit/s < min_bandwidth_gbps {self.min_bandwidth_gbps:g}"
                )
            if rtt is not None and rtt * 1e3 / 2 > self.max_latency_ms:
                reasons.append(
                    f"one-way latency {rtt * 1e3 / 2:.3g} ms > max_latency_ms {self.max_latency_ms:g}"
                )
            if loss > self.max_loss_rate:
                reasons.append(f"loss rate {loss:.3g} > {self.max_loss_rate:g}")
            return LinkSnapshot(
                bandwidth_bps=bw,
                rtt_ms=None if rtt is None else rtt * 1e3,
                min_rtt_ms=None if self._min_rtt is None else self._min_rtt * 1e3,
                loss_rate=loss,
                retransmit_rate=retx,
                samples=self._samples,
                rtt_samples=self._rtt_samples,
                up=up,
                healthy=not reasons,
                reasons=tuple(reasons),
                age_s=None if self._last_any is None else now - self._last_any,
            )

    # ------------------------------------------------------------------ internals

    def _success(self) -> float:
        now = self._clock()
        self._failures = 0
        self._last_any = now
        return now

    def _fresh(self, last: float | None, now: float) -> bool:
        return last is not None and (self.stale_after_s is None or now - last <= self.stale_after_s)


def _fraction(what: str, part: int, whole: int) -> float:
    if whole <= 0 or not 0 <= part <= whole:
        raise ValueError(f"{what} needs 0 <= part <= whole and whole > 0, got {part} of {whole}")
    return part / whole
