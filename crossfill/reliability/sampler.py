"""Resource samples of every process of the cluster (psutil) and of every worker's KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import psutil

from crossfill.reliability.cluster import ClusterView
from crossfill.reliability.procs import UpProcess


@dataclass(frozen=True)
class ProcSample:
    t: float  # seconds since the soak started
    name: str  # 'up', an instance name, 'scheduler', 'gateway', 'links', 'mooncake_master'
    pid: int
    rss: int  # bytes
    fds: int
    threads: int


@dataclass(frozen=True)
class KVSample:
    t: float
    name: str
    blocks_used: int
    active_requests: int


class Sampler:
    def __init__(self, up: UpProcess, view: ClusterView, t0: float) -> None:
        self.up = up
        self.view = view
        self.t0 = t0
        self.procs: list[ProcSample] = []
        self.kv: list[KVSample] = []

    async def sample(self) -> None:
        t = time.monotonic() - self.t0
        processes = {"up": psutil.Process(self.up.pid), **self.up.children()}
        for name, proc in processes.items():
            with contextlib.suppress(psutil.Error):  # it may exit between listing and reading
                with proc.oneshot():
                    self.procs.append(ProcSample(t, name, proc.pid, proc.memory_info().rss, proc.num_fds(),
                                                 proc.num_threads()))
        held = await self.view.kv_held()
        for name, value in held.workers.items():
            if value is not None:  # a restarting worker has no KV to report
                self.kv.append(KVSample(t, name, *value))

    async def run(self, every_s: float, stop: asyncio.Event) -> None:
        """Sample now and every `every_s` seconds until `stop` is set, then once more."""
        while True:
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            if stop.is_set():
                await self.sample()
                return
