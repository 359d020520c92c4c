"""Link monitor: the scheduler's one estimate of a link's RTT, bandwidth, loss, health and breaker.

The scheduler decides "remote prefill or not" from a snapshot of the link (M5.7, M5.4: monitor
utilisation, loss, retransmits, latency). Configured numbers say what the link should do; this says
what it did recently, from evidence the system produces anyway:

- `record_rtt(seconds)`: a small probe's round trip (see `crossfill.net.probe`).
- `record_bandwidth(nbytes, seconds)`: bytes over the wire time of a link-limited phase (an active
  payload probe, or a transfer phase that only waited on the link). Samples under
  `min_sample_bytes` are ignored: they measure latency, not bandwidth.
- `record_transfer(ok, frames, lost, retransmitted)`: one KV transfer's outcome and frame counts.
- `record_probe(ok)`: a probe answered, or failed outright (refused, reset, timed out).

Why windowed min/max filters and not moving averages (BBR's estimators)
-------------------------------------------------------------------------
Every sample is taken by a program on a possibly loaded machine, and that noise has a *sign*: an
event loop that is late, a descheduled thread or a GC pause can only make a round trip look longer
and a transfer look slower, never the reverse. A moving average mixes that one-sided noise into the
estimate (the EWMA this module used to have let one 50.8 ms probe on a 5 ms link flip a CI run to
unhealthy). BBR (Cardwell et al., "BBR: Congestion-Based Congestion Control", 2016) faces the same
problem and estimates each quantity with the filter that noise cannot move:

- RTT: the MINIMUM of the last `rtt_window` samples. A late probe never raises it. A real, sustained
  rise shows once the window has turned over (every sample in it is slow), i.e. after `rtt_window`
  samples; a fall shows at the first fast sample.
- Bandwidth: the MAXIMUM of the samples taken in the last `bandwidth_window_s` seconds. A busy
  machine only lowers samples. A real slow-down shows once the faster samples have aged out of the
  window; a speed-up shows at the first fast sample. The window is in time rather than samples
  because bandwidth samples come irregularly (transfers), and a burst of them must not flush a
  faster sample from a second ago. When no sample is in the window the bandwidth is unmeasured
  (None) rather than a stale number: the caller falls back to the configured capacity.

The flip side is that a max filter holds on to an *over*estimate for a whole window, so a caller
of `record_bandwidth` must time a sample so that noise can only add time: include all of the wire
time (never start the clock after bytes may already have arrived) and leave out only what is
certainly not wire time.

Health with hysteresis
----------------------
Each quantity is judged on its own samples against the seed config's thresholds, as the routing
policy judges them: a probe's RTT judges latency (one-way = RTT / 2 > `max_latency_ms`), a bandwidth
sample judges bandwidth (< `min_bandwidth_gbps`), a transfer judges loss (> `max_loss_rate`). An
unmeasured quantity is never bad: the configured link is trusted until evidence arrives, so a fresh
monitor is healthy. A quantity turns unhealthy only after `unhealthy_after` bad evaluations *of its
own* in a row and healthy again only after `healthy_after` good ones, so a link near a threshold does
not flap, and one low bandwidth sample is not judged again at every RTT probe (which would pass
`unhealthy_after` within a second). The link is healthy when every quantity is. Probe outcomes
(`record_probe`) are not measurements and do not count as evaluations. Health only changes on
evidence: a monitor fed nothing keeps its last verdict.

Up / down and the circuit breaker
---------------------------------
`up` is reachability: `failures_to_down` failed probes or transfers in a row mark the link down, the
next successful one marks it up. The circuit breaker is about transfers: `breaker_failures` failed
transfers in a row open it, and the scheduler sends no KV over an open link. After
`breaker_cooldown_s` it is half-open: the link has to prove itself with `half_open_successes`
successful probes (or one successful transfer, if one is attempted); a failure in half-open re-opens
it for a new cooldown. While open, outcomes of transfers that were already in flight change nothing
(they were started before the breaker opened and say nothing about the cooldown having helped).
`usable` = up and healthy and breaker closed is what routing should check.

All times come from the injected `clock` (default `time.monotonic`), so tests drive the windows and
the cooldown with a fake clock instead of sleeping. Everything is guarded by one lock (the scheduler
records from its event loop and reads from request handlers) and costs O(window) at most.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class LinkSnapshot:
    """What the link did recently, judged against the thresholds. None = not measured."""

    rtt_ms: float | None  # min of the last `rtt_window` RTT samples
    bandwidth_gbps: float | None  # max of the samples of the last `bandwidth_window_s`; None: none there
    configured_bandwidth_gbps: float | None  # what the topology (or an operator) says the link has
    loss_rate: float  # frames lost / frames sent over the last `stats_window` transfers
    retransmit_rate: float  # frames retransmitted / frames sent, same window (may exceed 1)
    up: bool  # False after `failures_to_down` failed probes/transfers in a row
    healthy: bool  # hysteresis-filtered verdict on rtt / bandwidth / loss
    breaker: BreakerState
    reasons: tuple[str, ...]  # why not usable (down, unhealthy, breaker); empty when usable
    rtt_samples: int  # RTT samples recorded since the start
    bandwidth_samples: int  # bandwidth samples accepted since the start
    transfers_ok: int
    transfers_failed: int

    @property
    def latency_ms(self) -> float | None:
        """One-way latency (RTT / 2), the quantity `network.max_latency_ms` bounds."""
        return None if self.rtt_ms is None else self.rtt_ms / 2

    @property
    def usable(self) -> bool:
        """Whether routing may send KV over the link now."""
        return self.up and self.healthy and self.breaker == "closed"

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly form (for `GET /v1/admin/cluster`), with the derived fields included."""
        d: dict[str, object] = asdict(self)
        d["reasons"] = list(self.reasons)
        d["latency_ms"] = self.latency_ms
        d["usable"] = self.usable
        return d


class NetworkThresholds(Protocol):
    """What `from_config` reads: the config's `inference_service.network` block has these."""

    @property
    def min_bandwidth_gbps(self) -> float: ...

    @property
    def max_latency_ms(self) -> float: ...


@dataclass
class _Verdict:
    """One quantity's health with its hysteresis state."""

    healthy: bool = True
    bad_streak: int = 0
    good_streak: int = 0
    reason: str = ""  # of the latest bad evaluation


class LinkMonitor:
    """Thread-safe estimator of one link; feed it samples and outcomes, read `snapshot()`.

    Args:
        min_bandwidth_gbps / max_latency_ms: health thresholds (config `network` block); latency is
            one way, i.e. RTT / 2.
        configured_bandwidth_gbps: the link's declared capacity, reported beside the measurement
            (routing falls back to it while bandwidth is unmeasured); not used to judge health.
        max_loss_rate: loss rate above which an evaluation is bad.
        rtt_window: RTT samples whose minimum is the RTT estimate.
        bandwidth_window_s: seconds of bandwidth samples whose maximum is the bandwidth estimate.
        stats_window: transfers whose frame counts give loss and retransmit rates.
        unhealthy_after / healthy_after: bad / good evaluations in a row that flip `healthy`.
        failures_to_down: failed probes or transfers in a row that mark the link down.
        breaker_failures: failed transfers in a row that open the circuit breaker.
        breaker_cooldown_s: how long the breaker stays open before it is half-open.
        half_open_successes: successful probes in half-open that close the breaker.
        min_sample_bytes: smaller bandwidth samples are ignored (they measure latency).
        clock: seconds, monotonic; injected so tests need not sleep.

    Raises:
        ValueError: an argument out of range; the message names it.
    """

    def __init__(
        self,
        *,
        min_bandwidth_gbps: float,
        max_latency_ms: float,
        configured_bandwidth_gbps: float | None = None,
        max_loss_rate: float = 0.05,
        rtt_window: int = 10,
        bandwidth_window_s: float = 5.0,
        stats_window: int = 20,
        unhealthy_after: int = 3,
        healthy_after: int = 2,
        failures_to_down: int = 3,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 10.0,
        half_open_successes: int = 2,
        min_sample_bytes: int = 64 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_number("min_bandwidth_gbps", min_bandwidth_gbps, low=0.0)
        _check_number("max_latency_ms", max_latency_ms, low=0.0, low_open=True, allow_inf=True)
        if configured_bandwidth_gbps is not None:
            _check_number("configured_bandwidth_gbps", configured_bandwidth_gbps, low=0.0, low_open=True)
        _check_number("max_loss_rate", max_loss_rate, low=0.0, high=1.0)
        _check_number("bandwidth_window_s", bandwidth_window_s, low=0.0, low_open=True)
        _check_number("breaker_cooldown_s", breaker_cooldown_s, low=0.0)
        for name, value, low in (
            ("rtt_window", rtt_window, 1),
            ("stats_window", stats_window, 1),
            ("unhealthy_after", unhealthy_after, 1),
            ("healthy_after", healthy_after, 1),
            ("failures_to_down", failures_to_down, 1),
            ("breaker_failures", breaker_failures, 1),
            ("half_open_successes", half_open_successes, 1),
            ("min_sample_bytes", min_sample_bytes, 0),
        ):
            _check_int(name, value, low)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")

        self.min_bandwidth_gbps = float(min_bandwidth_gbps)
        self.max_latency_ms = float(max_latency_ms)
        self.max_loss_rate = float(max_loss_rate)
        self.bandwidth_window_s = float(bandwidth_window_s)
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.failures_to_down = failures_to_down
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = float(breaker_cooldown_s)
        self.half_open_successes = half_open_successes
        self.min_sample_bytes = min_sample_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._configured_gbps = None if configured_bandwidth_gbps is None else float(configured_bandwidth_gbps)

        self._rtts: deque[float] = deque(maxlen=rtt_window)  # seconds
        # Monotonic deque of (time, Gbit/s) with strictly decreasing rates: a sample that is older
        # *and* slower than a newer one can never be the window's max again, so it is dropped on
        # arrival of the newer one. The window's max is then always the head (after expiring).
        self._bw: deque[tuple[float, float]] = deque()
        self._stats: deque[tuple[int, int, int]] = deque(maxlen=stats_window)  # frames, lost, retx
        self._rtt_samples = 0
        self._bw_samples = 0
        self._transfers_ok = 0
        self._transfers_failed = 0

        self._verdicts = {q: _Verdict() for q in ("latency", "bandwidth", "loss")}

        self._failures = 0  # failed probes/transfers in a row, for `up`
        self._breaker: BreakerState = "closed"
        self._breaker_fails = 0  # failed transfers in a row while closed
        self._opened_at = 0.0
        self._half_open_ok = 0

    @classmethod
    def from_config(
        cls,
        network_config: NetworkThresholds,
        configured_bandwidth_gbps: float | None = None,
        **kw: Any,
    ) -> LinkMonitor:
        """Build from the config's `inference_service.network` block; `kw` go to the constructor."""
        return cls(
            min_bandwidth_gbps=network_config.min_bandwidth_gbps,
            max_latency_ms=network_config.max_latency_ms,
            configured_bandwidth_gbps=configured_bandwidth_gbps,
            **kw,
        )

    # ------------------------------------------------------------------ measurements

    def record_rtt(self, seconds: float) -> None:
        """A small probe's round trip. A measurement only: report the probe's outcome with
        `record_probe` (a prober calls both; only this one counts toward health)."""
        _check_number("seconds", seconds, low=0.0, what="record_rtt")
        with self._lock:
            self._rtts.append(float(seconds))
            self._rtt_samples += 1
            self._evaluate(self._clock(), "latency")

    def record_bandwidth(self, nbytes: int, seconds: float) -> None:
        """`nbytes` crossed the link in `seconds` of wire time (a link-limited phase).

        Time it so that noise can only make it longer (see the module docstring): the estimate is a
        max filter, which keeps an overestimate for `bandwidth_window_s`.
        """
        _check_int("nbytes", nbytes, 0, what="record_bandwidth")
        _check_number("seconds", seconds, low=0.0, low_open=True, what="record_bandwidth")
        if nbytes < self.min_sample_bytes:
            return
        gbps = nbytes * 8 / seconds / 1e9
        with self._lock:
            now = self._clock()
            while self._bw and self._bw[-1][1] <= gbps:
                self._bw.pop()
            self._bw.append((now, gbps))
            self._bw_samples += 1
            self._evaluate(now, "bandwidth")

    def record_transfer(self, ok: bool, frames: int = 0, lost: int = 0, retransmitted: int = 0) -> None:
        """One KV transfer's outcome, with its frame counts when the transport has them.

        Every transfer takes a slot of the `stats_window`, with or without counts, so old loss ages
        out as traffic flows. `ok=False` counts toward `up` and the circuit breaker.
        """
        _check_int("frames", frames, 0, what="record_transfer")
        _check_int("lost", lost, 0, what="record_transfer")
        _check_int("retransmitted", retransmitted, 0, what="record_transfer")
        if lost > frames:
            raise ValueError(f"record_transfer: lost must be <= frames, got lost={lost}, frames={frames}")
        with self._lock:
            now = self._clock()
            self._stats.append((frames, lost, retransmitted))
            state = self._breaker_state(now)
            if ok:
                self._transfers_ok += 1
                self._failures = 0
                if state == "closed":
                    self._breaker_fails = 0
                elif state == "half_open":
                    self._close_breaker()
            else:
                self._transfers_failed += 1
                self._failures += 1
                if state == "closed":
                    self._breaker_fails += 1
                    if self._breaker_fails >= self.breaker_failures:
                        self._open_breaker(now)
                elif state == "half_open":
                    self._open_breaker(now)
            self._evaluate(now, "loss")

    def record_probe(self, ok: bool) -> None:
        """A probe that answered (`ok`) or failed outright (refused, reset, timed out).

        Drives `up`, and in half-open the breaker: `half_open_successes` answers close it, one
        failure re-opens it. Not a measurement, so it does not count toward health.
        """
        with self._lock:
            now = self._clock()
            state = self._breaker_state(now)
            if ok:
                self._failures = 0
                if state == "half_open":
                    self._half_open_ok += 1
                    if self._half_open_ok >= self.half_open_successes:
                        self._close_breaker()
            else:
                self._failures += 1
                if state == "half_open":
                    self._open_breaker(now)

    def set_configured_bandwidth(self, gbps: float | None) -> None:
        """Change the declared capacity (an operator's `POST /v1/admin/links/{dc}`); None clears it."""
        if gbps is not None:
            _check_number("configured_bandwidth_gbps", gbps, low=0.0, low_open=True)
        with self._lock:
            self._configured_gbps = None if gbps is None else float(gbps)

    # ------------------------------------------------------------------ reading

    def snapshot(self) -> LinkSnapshot:
        with self._lock:
            now = self._clock()
            rtt_ms, bw, loss, retx = self._estimates(now)
            breaker = self._breaker_state(now)
            up = self._failures < self.failures_to_down
            reasons: list[str] = []
            if not up:
                reasons.append(
                    f"link down: {self._failures} failed probes/transfers in a row "
                    f"(failures_to_down {self.failures_to_down})"
                )
            for v in self._verdicts.values():
                if v.healthy:
                    continue
                reasons.append(v.reason)
                if v.good_streak:
                    reasons.append(
                        f"recovering: {v.good_streak} of healthy_after {self.healthy_after} "
                        "good evaluations"
                    )
            if breaker == "open":
                left = self._opened_at + self.breaker_cooldown_s - now
                reasons.append(
                    f"circuit breaker open: failed transfers (breaker_failures {self.breaker_failures}); "
                    f"half-open in {left:.3g} s"
                )
            elif breaker == "half_open":
                reasons.append(
                    f"circuit breaker half-open: {self._half_open_ok} of half_open_successes "
                    f"{self.half_open_successes} successful probes"
                )
            return LinkSnapshot(
                rtt_ms=rtt_ms,
                bandwidth_gbps=bw,
                configured_bandwidth_gbps=self._configured_gbps,
                loss_rate=loss,
                retransmit_rate=retx,
                up=up,
                healthy=self._healthy,
                breaker=breaker,
                reasons=tuple(reasons),
                rtt_samples=self._rtt_samples,
                bandwidth_samples=self._bw_samples,
                transfers_ok=self._transfers_ok,
                transfers_failed=self._transfers_failed,
            )

    # ------------------------------------------------------------------ internals (lock held)

    def _estimates(self, now: float) -> tuple[float | None, float | None, float, float]:
        """(rtt_ms, bandwidth_gbps, loss_rate, retransmit_rate) as of `now`."""
        rtt_ms = min(self._rtts) * 1e3 if self._rtts else None
        horizon = now - self.bandwidth_window_s
        while self._bw and self._bw[0][0] < horizon:
            self._bw.popleft()
        bw = self._bw[0][1] if self._bw else None
        frames = sum(s[0] for s in self._stats)
        loss = sum(s[1] for s in self._stats) / frames if frames else 0.0
        retx = sum(s[2] for s in self._stats) / frames if frames else 0.0
        return rtt_ms, bw, loss, retx

    def _evaluate(self, now: float, quantity: str) -> None:
        """Judge `quantity` (latency | bandwidth | loss) on its current estimate; advance its hysteresis.

        Each quantity is judged on its own samples only: a latency verdict moves with probes, a
        bandwidth verdict with bandwidth samples. Otherwise one low bandwidth sample (taken while
        the far side was busy starting up) would be judged again at every RTT probe and pass
        `unhealthy_after` within a second, which is no sustained signal at all.
        """
        rtt_ms, bw, loss, _ = self._estimates(now)
        bad: str | None = None
        if quantity == "latency" and rtt_ms is not None and rtt_ms / 2 > self.max_latency_ms:
            bad = f"one-way latency {rtt_ms / 2:.3g} ms > max_latency_ms {self.max_latency_ms:g}"
        elif quantity == "bandwidth" and bw is not None and bw < self.min_bandwidth_gbps:
            bad = f"bandwidth {bw:.3g} Gbit/s < min_bandwidth_gbps {self.min_bandwidth_gbps:g}"
        elif quantity == "loss" and loss > self.max_loss_rate:
            bad = f"loss rate {loss:.3g} > max_loss_rate {self.max_loss_rate:g}"
        v = self._verdicts[quantity]
        if bad is not None:
            v.reason = bad
            v.bad_streak += 1
            v.good_streak = 0
            if v.healthy and v.bad_streak >= self.unhealthy_after:
                v.healthy = False
        else:
            v.good_streak += 1
            v.bad_streak = 0
            if not v.healthy and v.good_streak >= self.healthy_after:
                v.healthy = True
                v.reason = ""

    @property
    def _healthy(self) -> bool:
        return all(v.healthy for v in self._verdicts.values())

    def _breaker_state(self, now: float) -> BreakerState:
        """The breaker's state as of `now`: an open breaker whose cooldown has passed is half-open."""
        if self._breaker == "open" and now - self._opened_at >= self.breaker_cooldown_s:
            self._breaker = "half_open"
            self._half_open_ok = 0
        return self._breaker

    def _open_breaker(self, now: float) -> None:
        self._breaker = "open"
        self._opened_at = now
        self._half_open_ok = 0

    def _close_breaker(self) -> None:
        self._breaker = "closed"
        self._breaker_fails = 0
        self._half_open_ok = 0


def _check_number(
    name: str,
    value: float,
    *,
    low: float,
    low_open: bool = False,
    high: float | None = None,
    allow_inf: bool = False,
    what: str | None = None,
) -> None:
    """Raise ValueError naming `name` unless `value` is a real number in range (NaN never is).

    numbers.Real rather than float so numpy scalars pass; bool is excluded because True as a
    threshold or a duration is always a caller's slip.
    """
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and not math.isnan(value)
        and (allow_inf or not math.isinf(value))
        and (value > low if low_open else value >= low)
        and (high is None or value <= high)
    )
    if not ok:
        rng = f"{'>' if low_open else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")
        prefix = f"{what}: " if what else ""
        raise ValueError(f"{prefix}{name} must be a {'' if allow_inf else 'finite '}number {rng}, got {value!r}")


def _check_int(name: str, value: int, low: int, *, what: str | None = None) -> None:
    """Raise ValueError naming `name` unless `value` is an integer >= `low` (a bool is not a count)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        prefix = f"{what}: " if what else ""
        raise ValueError(f"{prefix}{name} must be an integer >= {low}, got {value!r}")
