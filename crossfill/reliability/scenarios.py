"""The chaos scenarios: each injects one fault into a cluster under steady load, waits for the event
that shows the fault really hit (a transfer on the wire, a stream mid-way, a counter moving), heals
or lets `crossfill up` heal it, and waits until the cluster routes to everything again.

A scenario returns a short note for its table row. Every wait is on an event; `Params.wait_s` is
only the safety net after which the scenario is reported as not carried out.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from crossfill.config import CrossfillConfig
from crossfill.reliability.cluster import ClusterView
from crossfill.reliability.load import LoadGenerator, until
from crossfill.reliability.procs import UpProcess


@dataclass(frozen=True)
class Params:
    short: bool
    concurrency: int  # steady load: clients sending back to back
    warm: int  # completions before the fault is injected
    after: int  # completions of requests sent after recovery, before the scenario ends
    max_tokens: int
    stream_tokens: int  # long streams, so a decode kill lands mid-stream
    partition_s: float
    repeats: int  # cuts and corruptions per scenario
    reorder_ms: float
    rate_drop: float  # the link's bandwidth is divided by this
    wait_s: float  # safety net of every wait
    deadline_s: float  # per request, at the client
    drain_s: float  # safety net of the wait for KV release


SHORT = Params(short=True, concurrency=4, warm=2, after=3, max_tokens=12, stream_tokens=160, partition_s=3.0,
               repeats=1, reorder_ms=20, rate_drop=20, wait_s=120, deadline_s=180, drain_s=60)
FULL = Params(short=False, concurrency=8, warm=8, after=16, max_tokens=24, stream_tokens=96, partition_s=60.0,
              repeats=3, reorder_ms=50, rate_drop=10, wait_s=300, deadline_s=420, drain_s=120)


@dataclass
class Ctx:
    cfg: CrossfillConfig
    up: UpProcess
    view: ClusterView
    load: LoadGenerator
    p: Params


@dataclass(frozen=True)
class Scenario:
    name: str
    mix: str  # the workload it runs under: "wan", "stream" or "overload"
    inject: Callable[[Ctx], Awaitable[str]]
    skip: Callable[[CrossfillConfig], str | None] = lambda cfg: None


def capacity(cfg: CrossfillConfig) -> int:
    """Requests the cluster holds at once before refusing: every prefill queue and decode slot."""
    svc = cfg.inference_service
    return (len(cfg.prefill_instances()) * svc.prefill_pool.max_queue_depth
            + len(cfg.decode_instances()) * svc.decode_pool.max_concurrent_requests)


def _no_remote(cfg: CrossfillConfig) -> str | None:
    if not any(c.kind == "kv" for c in cfg.crossings()):
        return "no emulated WAN link with a remote prefill instance in this topology"
    return None


def kv_crosses_link(cfg: CrossfillConfig) -> bool:
    """KV bytes (or, for mooncake_te, the frame/commit handshake) pass decode's emulated KV port.
    With a Mooncake Store, prefill writes into the store cluster directly: not through the emulator."""
    kv = cfg.inference_service.kv_cache
    return not (kv.transport == "store" and kv.store == "mooncake")


def _no_kv_on_link(cfg: CrossfillConfig) -> str | None:
    if (why := _no_remote(cfg)) is not None:
        return why
    if not kv_crosses_link(cfg):
        return "KV does not cross the emulated link with kv_cache.store mooncake (prefill writes to the store)"
    return None


def _no_store(cfg: CrossfillConfig) -> str | None:
    kv = cfg.inference_service.kv_cache
    if not kv.start_mooncake_master:
        return (f"kv_cache.start_mooncake_master is off (transport {kv.transport}): "
                "no KV store process runs under crossfill up")
    return None


async def _rejoin(ctx: Ctx, name: str, pid: int, ready: Callable[[], object]) -> None:
    await until(f"crossfill up restarts {name}", lambda: ctx.up.replaced(name, pid), ctx.p.wait_s)
    await until(f"{name} is back in service", ready, ctx.p.wait_s)


async def kill_remote_prefill(ctx: Ctx) -> str:
    name, kv = ctx.view.remote_prefills[0], ctx.view.crossings("kv")
    on_link = kv_crosses_link(ctx.cfg)
    before = await ctx.view.counter(kv, "up.bytes_in")
    if on_link:  # hold KV on the wire so the kill lands mid-transfer, however fast this machine is
        await ctx.view.arm(kv, stall_ms=600_000)
    try:
        async def mid_transfer() -> bool:
            holds = (await ctx.view.worker_stats(name))["queue_depth"] > 0
            return holds and (not on_link or await ctx.view.counter(kv, "up.bytes_in") > before)

        await until(f"{name} has KV on the wire", mid_transfer, ctx.p.wait_s)
        pid = ctx.up.kill9(name)
    finally:
        await ctx.view.disarm(kv)
    await _rejoin(ctx, name, pid, lambda: ctx.view.instance_healthy(name))
    return f"kill -9 {name} mid-transfer" if on_link else f"kill -9 {name} mid-prefill"


async def kill_decode(ctx: Ctx) -> str:
    name = ctx.view.decodes[0]
    await until("a stream is between its first token and its end", lambda: ctx.load.streams_mid > 0,
                ctx.p.wait_s, load=ctx.load)
    mid = ctx.load.streams_mid
    pid = ctx.up.kill9(name)
    await _rejoin(ctx, name, pid, ctx.view.all_healthy)
    return f"kill -9 {name} with {mid} stream(s) mid-way"


async def link_cut(ctx: Ctx) -> str:
    kv = ctx.view.crossings("kv")
    for _ in range(ctx.p.repeats):
        before = await ctx.view.counter(kv, "cuts")
        await ctx.view.arm(kv, cut_after_bytes=16_000)  # well inside one transfer, even of a tiny model

        async def cut(before: float = before) -> bool:
            return await ctx.view.counter(kv, "cuts") > before

        await until("the KV link was cut", cut, ctx.p.wait_s, every=0.2)
    return f"{ctx.p.repeats} cut(s) of the KV link"


async def link_stall(ctx: Ctx) -> str:
    kv = ctx.view.crossings("kv")
    stall_ms = 2 * ctx.cfg.inference_service.kv_cache.timeout_ms  # past decode's timeout: it retries
    before = await ctx.view.counter(kv, "up.bytes_in")
    await ctx.view.arm(kv, stall_ms=stall_ms)
    await until("the stall is over", lambda: ctx.view.faults_over(kv), ctx.p.wait_s + stall_ms / 1e3, every=0.2)
    held = await ctx.view.counter(kv, "up.bytes_in") - before
    return f"stall {stall_ms / 1e3:g}s of the KV link ({held / 1e3:.0f} kB entered it meanwhile)"


async def link_corrupt(ctx: Ctx) -> str:
    kv = ctx.view.crossings("kv")
    for _ in range(ctx.p.repeats):
        before = await ctx.view.counter(kv, "up.corrupted_bytes")
        await ctx.view.arm(kv, corrupt_bytes=64)

        async def flipped(before: float = before) -> bool:
            return await ctx.view.counter(kv, "up.corrupted_bytes") >= before + 64

        await until("64 KV bytes were corrupted", flipped, ctx.p.wait_s, every=0.2)
    return f"{ctx.p.repeats}×64 corrupted KV bytes"


async def link_reorder(ctx: Ctx) -> str:
    kv = ctx.view.crossings("kv")
    await ctx.view.arm(kv, reorder_ms=ctx.p.reorder_ms)
    armed = time.monotonic()
    try:
        await until(f"{ctx.p.after} remote answers under reordering",
                    lambda: _remote_since(ctx.load, armed) >= ctx.p.after, ctx.p.wait_s, load=ctx.load)
        chunks = await ctx.view.counter(kv, "reordered_chunks")
    finally:
        await ctx.view.disarm(kv)
    return f"reorder up to {ctx.p.reorder_ms:g} ms ({chunks:.0f} chunks delayed)"


async def link_rate_drop(ctx: Ctx) -> str:
    crossings = ctx.view.crossings()
    old = {c.control_port: (await ctx.view.link(c))["settings"]["bandwidth_bps"] for c in crossings}
    dropped = {port: (bw or 1e9) / ctx.p.rate_drop for port, bw in old.items()}
    for c in crossings:
        await ctx.view.set_link(c, bandwidth=dropped[c.control_port])
    dropped_at = time.monotonic()
    try:
        await until(f"{ctx.p.after} answers at the dropped rate",
                    lambda: ctx.load.completed_since(dropped_at) >= ctx.p.after, ctx.p.wait_s, load=ctx.load)
    finally:
        for c in crossings:
            await ctx.view.set_link(c, bandwidth=old[c.control_port])
    return f"bandwidth ÷{ctx.p.rate_drop:g} ({min(dropped.values()) / 1e6:g} Mbit/s)"


async def link_partition(ctx: Ctx) -> str:
    crossings = ctx.view.crossings()  # the whole link: KV and the prefill's HTTP both go down
    await ctx.view.arm(crossings, partition_ms=ctx.p.partition_s * 1e3)
    await until("the partition is over", lambda: ctx.view.faults_over(crossings),
                ctx.p.partition_s + ctx.p.wait_s, every=0.5)
    held = await ctx.view.counter(crossings, "held_connections")
    await until("the scheduler routes across the link again", ctx.view.all_healthy, ctx.p.wait_s)
    return f"partition {ctx.p.partition_s:g}s ({held:.0f} connection(s) held)"


def _restart(name: str) -> Callable[[Ctx], Awaitable[str]]:
    async def restart(ctx: Ctx) -> str:
        pid = ctx.up.terminate(name)
        await _rejoin(ctx, name, pid, ctx.view.cluster_ready)
        return f"SIGTERM {name}, restarted by crossfill up"

    return restart


async def overload(ctx: Ctx) -> str:
    def refused() -> int:
        return ctx.load.count(lambda o: o.verdict == "failed" and o.status in (429, 503))

    await until("requests beyond capacity are refused", lambda: refused() > 0, ctx.p.wait_s, load=ctx.load)
    return f"{ctx.load.concurrency} concurrent clients, 3× capacity {capacity(ctx.cfg)}"


def _remote_since(load: LoadGenerator, t: float) -> int:
    return load.count(lambda o: o.verdict == "completed" and o.started >= t
                      and bool(o.route and o.route.get("route") == "remote"))


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("kill-remote-prefill", "wan", kill_remote_prefill, _no_remote),
    Scenario("link-cut", "wan", link_cut, _no_kv_on_link),
    Scenario("link-stall", "wan", link_stall, _no_kv_on_link),
    Scenario("link-corrupt", "wan", link_corrupt, _no_kv_on_link),
    Scenario("link-reorder", "wan", link_reorder, _no_kv_on_link),
    Scenario("link-rate-drop", "wan", link_rate_drop, _no_remote),
    Scenario("link-partition", "wan", link_partition, _no_remote),
    Scenario("kill-decode", "stream", kill_decode),
    Scenario("restart-scheduler", "wan", _restart("scheduler")),
    Scenario("restart-gateway", "wan", _restart("gateway")),
    Scenario("restart-kv-store", "wan", _restart("mooncake_master"), _no_store),
    Scenario("overload", "overload", overload),
)
