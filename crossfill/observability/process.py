"""What the process itself uses: its "accelerator" (the CPU here; CUDA devices where torch sees one).

M5.10 asks for accelerator utilisation and memory. A CPU-only process reports `device="cpu"`:
utilisation is its CPU time over wall time and the cores it may use, memory its RSS against the
machine's. Where `torch.cuda.is_available()`, each GPU adds `device="cuda:N"` with torch's
allocated and total memory (and utilisation when torch can read it through NVML). prometheus_client's
standard `process_*` series (CPU seconds, RSS, open fds) are registered beside them.

Everything is read at scrape time: nothing runs between scrapes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_MIN_WINDOW_S = 1.0  # scrapes closer together than this share a baseline (two scrapers interleaving)


def _usable_cores() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # not Linux
        return max(os.cpu_count() or 1, 1)


class AcceleratorCollector(Collector):
    """`crossfill_accelerator_{utilization_ratio,memory_used_bytes,memory_total_bytes}{device}`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._proc = psutil.Process()
        self._clock = clock
        self._cores = _usable_cores()
        # Baseline: the process start, so the first scrape reports the average since then.
        self._base = (clock() - (time.time() - self._proc.create_time()), 0.0)
        self._last_ratio = 0.0

    def _cpu_ratio(self) -> float:
        now = self._clock()
        t = self._proc.cpu_times()
        cpu = t.user + t.system
        base_t, base_cpu = self._base
        if now - base_t >= _MIN_WINDOW_S:
            self._last_ratio = max(cpu - base_cpu, 0.0) / ((now - base_t) * self._cores)
            self._base = (now, cpu)
        return self._last_ratio

    def collect(self) -> Iterator[GaugeMetricFamily]:
        util = GaugeMetricFamily("crossfill_accelerator_utilization_ratio",
                                 "Busy share of the accelerator (device=cpu: process CPU time / (wall time x usable "
                                 "cores) since the previous scrape)", labels=["device"])
        used = GaugeMetricFamily("crossfill_accelerator_memory_used_bytes",
                                 "Accelerator memory in use (device=cpu: process RSS)", labels=["device"])
        total = GaugeMetricFamily("crossfill_accelerator_memory_total_bytes",
                                  "Accelerator memory (device=cpu: the machine's)", labels=["device"])
        util.add_metric(["cpu"], self._cpu_ratio())
        used.add_metric(["cpu"], float(self._proc.memory_info().rss))
        total.add_metric(["cpu"], float(psutil.virtual_memory().total))
        for device, u, m_used, m_total in _cuda_devices():
            if u is not None:
                util.add_metric([device], u)
            used.add_metric([device], m_used)
            total.add_metric([device], m_total)
        yield util
        yield used
        yield total


def _cuda_devices() -> list[tuple[str, float | None, float, float]]:
    """(device, utilisation 0..1 or None, allocated bytes, total bytes) per visible GPU; [] without one."""
    torch = sys.modules.get("torch")  # only where the process loaded torch already (workers): never import it here
    if torch is None or not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        try:
            util: float | None = torch.cuda.utilization(i) / 100
        except Exception:  # noqa: BLE001 - needs NVML (pynvml); memory is still worth reporting
            util = None
        out.append((f"cuda:{i}", util, float(torch.cuda.memory_allocated(i)),
                    float(torch.cuda.get_device_properties(i).total_memory)))
    return out


def register_process_metrics(registry: CollectorRegistry) -> None:
    ProcessCollector(registry=registry)
    registry.register(AcceleratorCollector())
