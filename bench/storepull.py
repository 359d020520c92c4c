"""Store-and-pull discovery: change notifications vs polling, side by side in one run.

    .venv/bin/python bench/storepull.py [--mb 4] [--runs 9] [--gap-ms 200] [--lead-ms 20] [--skip-mooncake]

Each cell is the median of --runs transfers of about --mb MB (codec none, frames of the default
size); the puller calls expect() --lead-ms before prefill starts uploading, as in serving. Per
transfer:
- tail:     from the start of the commit object's `put` to the puller's `wait()` returning
            (this includes deleting the consumed objects, which `wait()` waits for);
- verified: from the same start to the commit digest matching (the tail without that clean-up);
- total:    from the sender's `open()` to `wait()` returning;
- gets:     store get calls the puller made for the transfer (the load waiting puts on the store).
Two scenarios: "burst" (commit right after the last frame) and "gap" (commit --gap-ms after the
last frame, e.g. prefill finishing late): by then a polling puller has backed off.

Sections:
1. EmbeddedStore: polling forced (a wrapper hides `watch`) vs change notifications.
2. Mooncake Store (a real mooncake_master on loopback; the writer and the reader are separate
   clients): polling vs polling plus the `notify()` hint, sent when the sender's commit() returns,
   as a control channel would (in-process here, so no control-channel delay is included).
   Skipped, with the reason printed, when the wheel or the master is unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.assembler import Expectation
from crossfill.kv.store import DEFAULT_TENANT, EmbeddedStore, StoreUnavailableError
from crossfill.kv.storepull import StorePullReceiver, StorePushSender
from crossfill.kv.wire import Manifest

LAYERS, HEADS, DIM = 8, 4, 64
DTYPE = torch.float32
TENANT = "bench"
FINGERPRINT = "b" * 64


# ------------------------------------------------------------------------------- store wrappers

class PollOnly:
    """A store without `watch`: the puller cannot be notified and polls (the baseline)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def put(self, key: str, data: bytes, ttl_s: float | None = None, tenant: str = DEFAULT_TENANT) -> None:
        self.inner.put(key, data, ttl_s, tenant)

    def get(self, key: str, tenant: str = DEFAULT_TENANT) -> bytes | None:
        return self.inner.get(key, tenant)

    def delete(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        return self.inner.delete(key, tenant)

    def exists(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        return self.inner.exists(key, tenant)

    def stats(self) -> Any:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


class Instrumented:
    """Forwards every call (so `watch` stays visible when the inner store has it); times the commit
    put and counts gets. Times are taken on the calling thread, before the inner call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.commit_put_at: dict[str, float] = {}
        self.gets = 0

    def put(self, key: str, data: bytes, ttl_s: float | None = None, tenant: str = DEFAULT_TENANT) -> None:
        if key.endswith("/commit"):
            self.commit_put_at[key.split("/")[1]] = time.monotonic()
        self.inner.put(key, data, ttl_s, tenant)

    def get(self, key: str, tenant: str = DEFAULT_TENANT) -> bytes | None:
        self.gets += 1  # from worker threads; a lost increment under contention is noise here
        return self.inner.get(key, tenant)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ------------------------------------------------------------------------------------ transfers

@dataclass
class Sample:
    tail: float
    verified: float
    total: float
    gets: int


def make_workload(mb: float) -> tuple[list[LayerSpec], int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    specs = [LayerSpec(i, "full", None, HEADS, DIM, DTYPE) for i in range(LAYERS)]
    tokens = max(16, int(mb * (1 << 20)) // sum(s.bytes_per_token for s in specs))
    g = torch.Generator().manual_seed(0)
    kv = {s.index: (torch.randn(tokens, HEADS, DIM, generator=g).to(DTYPE),
                    torch.randn(tokens, HEADS, DIM, generator=g).to(DTYPE)) for s in specs}
    return specs, tokens, kv


def manifest_for(cache_id: str, specs: list[LayerSpec], tokens: int) -> Manifest:
    return Manifest.build(cache_id=cache_id, request_id=cache_id, tenant=TENANT, fingerprint=FINGERPRINT,
                          token_ids=list(range(tokens)), layer_specs=specs, ttl_s=120.0)


async def upload(sender: StorePushSender, m: Manifest, kv: dict, gap_s: float, rx: StorePullReceiver | None) -> float:
    """Prefill's side; returns when open() began. `rx` given: send the notify() hint after commit."""
    t_open = time.monotonic()
    async with sender.open(m) as tx:
        for layer in sorted(kv):
            await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
        if gap_s:
            await asyncio.sleep(gap_s)
        await tx.commit()
    if rx is not None:
        rx.notify(m.cache_id)
    return t_open


async def one_transfer(writer: Instrumented, reader: Instrumented, rx: StorePullReceiver, cache_id: str,
                       workload: tuple, gap_s: float, lead_s: float, hint: bool) -> Sample:
    specs, tokens, kv = workload
    m = manifest_for(cache_id, specs, tokens)
    gets0 = reader.gets
    rx.expect(Expectation(cache_id, lambda chunk: None, fingerprint=FINGERPRINT, tenant=TENANT))
    verified_at: list[float] = []
    # Private access, for the benchmark only: when the commit digest matched, before the clean-up.
    rx._pulls[cache_id].assembly.done.add_done_callback(lambda _: verified_at.append(time.monotonic()))
    await asyncio.sleep(lead_s)  # decode is ready before prefill starts
    up = asyncio.create_task(upload(StorePushSender(writer), m, kv, gap_s, rx if hint else None))
    await rx.wait(cache_id)
    t_done = time.monotonic()
    t_open = await up
    t_commit = writer.commit_put_at.pop(cache_id)
    return Sample(t_done - t_commit, verified_at[0] - t_commit, t_done - t_open, reader.gets - gets0)


@dataclass
class Mode:
    name: str
    writer: Instrumented
    reader: Instrumented
    rx: StorePullReceiver
    hint: bool = False


async def compare(title: str, modes: list[Mode], args: argparse.Namespace, workload: tuple) -> None:
    specs, tokens, _ = workload
    frames = manifest_for("probe", specs, tokens).frame_count
    mb = tokens * sum(s.bytes_per_token for s in specs) / (1 << 20)
    print(f"\n{title}: {mb:.1f} MB in {frames} frames, median of {args.runs} runs")
    print(f"  {'scenario':<12} {'mode':<14} {'tail ms':>9} {'verified ms':>12} {'total ms':>9} {'gets':>6}")
    for scenario, gap_s in (("burst", 0.0), (f"gap {args.gap_ms:g} ms", args.gap_ms / 1000)):
        results: dict[str, list[Sample]] = {m.name: [] for m in modes}
        for run in range(args.runs + 1):
            for mode in modes if run % 2 else reversed(modes):  # alternate order: no mode always goes first
                cid = f"{mode.name}-{scenario.split()[0]}-{run}"
                s = await one_transfer(mode.writer, mode.reader, mode.rx, cid, workload, gap_s,
                                       args.lead_ms / 1000, mode.hint)
                if run:  # run 0 warms up threads, allocators and the store
                    results[mode.name].append(s)
        med = {name: _medians(samples) for name, samples in results.items()}
        for name, (tail, verified, total, gets) in med.items():
            print(f"  {scenario:<12} {name:<14} {tail * 1e3:9.2f} {verified * 1e3:12.2f} {total * 1e3:9.1f} "
                  f"{gets:6.0f}")
        base, new = med[modes[0].name], med[modes[1].name]
        print(f"  {'':<12} {'ratio':<14} {_ratio(base[0], new[0]):>9} {_ratio(base[1], new[1]):>12} "
              f"{_ratio(base[2], new[2]):>9} {_ratio(base[3], new[3]):>6}   ({modes[0].name} / {modes[1].name})")


def _medians(samples: list[Sample]) -> tuple[float, float, float, float]:
    return (statistics.median(s.tail for s in samples), statistics.median(s.verified for s in samples),
            statistics.median(s.total for s in samples), statistics.median(s.gets for s in samples))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "n/a"


# -------------------------------------------------------------------------------------- sections

async def embedded_section(args: argparse.Namespace, workload: tuple) -> None:
    store = EmbeddedStore(memory_capacity_bytes=256 << 20)
    try:
        modes = []
        for name, reader_store in (("poll", PollOnly(store)), ("notify", store)):
            reader = Instrumented(reader_store)
            modes.append(Mode(name, Instrumented(store), reader, StorePullReceiver(reader)))
        await compare("EmbeddedStore: polling forced vs change notifications", modes, args, workload)
    finally:
        store.close()


def start_mooncake() -> tuple[Any, Any, Any] | str:
    """(master, writer client, reader client), or the reason Mooncake cannot run here."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"the mooncake module is not importable ({exc})"
    from crossfill.kv.store.mooncake import MooncakeStore
    from crossfill.kv.store.mooncake_master import MooncakeMaster

    try:
        master = MooncakeMaster(log_dir=tempfile.mkdtemp(prefix="bench-mooncake-")).start()
    except (StoreUnavailableError, OSError) as exc:
        return f"mooncake_master did not start: {exc}"
    try:
        writer = MooncakeStore(master.address, global_segment_bytes=256 << 20, local_buffer_bytes=32 << 20)
        reader = MooncakeStore(master.address, global_segment_bytes=0, local_buffer_bytes=32 << 20)
    except StoreUnavailableError as exc:
        master.stop()
        return f"Mooncake Store clients did not start: {exc}"
    return master, writer, reader


async def mooncake_section(args: argparse.Namespace, workload: tuple) -> None:
    started = start_mooncake()
    if isinstance(started, str):
        print(f"\nMooncake Store: skipped: {started}")
        return
    master, writer_store, reader_store = started
    try:
        modes = []
        for name, hint in (("poll", False), ("poll+hint", True)):
            reader = Instrumented(reader_store)
            modes.append(Mode(name, Instrumented(writer_store), reader, StorePullReceiver(reader), hint))
        await compare("Mooncake Store (no watch API): polling vs polling + notify() hint", modes, args, workload)
    finally:
        reader_store.close()
        writer_store.close()
        master.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=4.0, help="KV bytes per transfer, in MB")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--gap-ms", type=float, default=200.0, help="idle time before the commit (gap scenario)")
    ap.add_argument("--lead-ms", type=float, default=20.0, help="time from expect() to the upload starting")
    ap.add_argument("--skip-mooncake", action="store_true")
    args = ap.parse_args()
    workload = make_workload(args.mb)
    await embedded_section(args, workload)
    if args.skip_mooncake:
        print("\nMooncake Store: skipped: --skip-mooncake")
    else:
        await mooncake_section(args, workload)


if __name__ == "__main__":
    asyncio.run(main())
