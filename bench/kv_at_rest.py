"""What sealing KV at rest costs: AES-GCM throughput, the store transport with it on vs off, and
what zeroing the engine's freed KV blocks would cost.

    .venv/bin/python bench/kv_at_rest.py [--mb 8] [--runs 9] [--skip-remote]

1. seal / open: MB/s of `KVCipher.seal` and `.open` (AES-256-GCM, one thread) on buffers of KV
   frame sizes, median of --runs.
2. store transport: whole transfers of about --mb MB (codec none) from `StorePushSender` to a
   `StorePullReceiver`, encryption off vs on, alternating, median of --runs each. "embedded":
   sender and puller on one in-process EmbeddedStore (the store's cost is a memcpy, so the cipher's
   share is as large as it gets); "remote": the sender reaches the store through a StoreServer on
   loopback TCP, as prefill does in a cluster.
3. engine blocks: time to zero one freed KV block across all layers of a 1B-class model's cache
   (16 layers, 8 KV heads x 64, bf16, 16-token blocks), the cost of zero-on-free.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.assembler import Expectation
from crossfill.kv.store import EmbeddedStore, KVStore
from crossfill.kv.store.remote import RemoteStore
from crossfill.kv.storepull import StorePullReceiver, StorePushSender
from crossfill.kv.wire import Manifest
from crossfill.security.kv_crypto import AtRest, KVCipher

TENANT = "bench"
FINGERPRINT = "b" * 64
LAYERS, HEADS, DIM = 8, 4, 64


def _median_s(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])  # the first run warms up


def cipher_section(runs: int) -> None:
    cipher = KVCipher([os.urandom(32)])
    names = {"tenant": TENANT, "cache_id": "c" * 32, "key": "kv/" + "c" * 32 + "/f/0"}
    print("1. AES-256-GCM on this CPU (one thread)")
    print(f"  {'buffer':>8} {'seal MB/s':>10} {'open MB/s':>10}")
    for size in (64 << 10, 256 << 10, 1 << 20, 8 << 20):
        data = os.urandom(size)
        blob = cipher.seal(data, **names)
        seal = _median_s(lambda data=data: cipher.seal(data, **names), runs)
        opened = _median_s(lambda blob=blob: cipher.open(blob, **names), runs)
        print(f"  {size >> 10:>6}Ki {size / seal / 1e6:10.0f} {size / opened / 1e6:10.0f}")


def _workload(mb: float) -> tuple[list[LayerSpec], int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    specs = [LayerSpec(i, "full", None, HEADS, DIM, torch.float32) for i in range(LAYERS)]
    tokens = max(16, int(mb * (1 << 20)) // sum(s.bytes_per_token for s in specs))
    g = torch.Generator().manual_seed(0)
    kv = {s.index: (torch.randn(tokens, HEADS, DIM, generator=g), torch.randn(tokens, HEADS, DIM, generator=g))
          for s in specs}
    return specs, tokens, kv


async def _transfer(writer: KVStore, rx: StorePullReceiver, at_rest: AtRest, cache_id: str, workload: tuple) -> float:
    specs, tokens, kv = workload
    m = Manifest.build(cache_id=cache_id, request_id=cache_id, tenant=TENANT, fingerprint=FINGERPRINT,
                       token_ids=list(range(tokens)), layer_specs=specs, ttl_s=120.0)
    rx.expect(Expectation(cache_id, lambda chunk: None, fingerprint=FINGERPRINT, tenant=TENANT))
    t = time.perf_counter()
    async with StorePushSender(writer, at_rest=at_rest).open(m) as tx:
        for layer in sorted(kv):
            await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
        await tx.commit()
    await rx.wait(cache_id)
    return time.perf_counter() - t


def _served(store: EmbeddedStore) -> AbstractContextManager[str]:
    """The store behind a StoreServer on its own loop and thread, as decode serves it to prefill."""
    import contextlib
    import threading

    from crossfill.kv.store.remote import StoreServer

    @contextlib.contextmanager
    def run():  # noqa: ANN202
        loop = asyncio.new_event_loop()
        server = StoreServer(store)
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
            yield server.address
        finally:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    return run()


async def store_section(args: argparse.Namespace) -> None:
    workload = _workload(args.mb)
    specs, tokens, _ = workload
    mb = tokens * sum(s.bytes_per_token for s in specs) / (1 << 20)
    cipher = KVCipher([os.urandom(32)])
    modes = {"off": AtRest(None), "on": AtRest(cipher)}
    print(f"\n2. store transport, {mb:.1f} MB per transfer (codec none), median of {args.runs} transfers")
    print(f"  {'store':<9} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    for where in ("embedded", "remote"):
        if where == "remote" and args.skip_remote:
            continue
        store = EmbeddedStore(memory_capacity_bytes=512 << 20)
        served = _served(store) if where == "remote" else nullcontext(None)
        with served as address:
            writer: KVStore = RemoteStore(address) if address else store
            samples: dict[str, list[float]] = {name: [] for name in modes}
            receivers = {name: StorePullReceiver(store, at_rest=a) for name, a in modes.items()}
            for run in range(args.runs + 1):
                for name in (list(modes) if run % 2 else list(reversed(modes))):
                    s = await _transfer(writer, receivers[name], modes[name], f"{where}-{name}-{run}", workload)
                    if run:
                        samples[name].append(s)
            if address:
                writer.close()
        store.close()
        off, on = (statistics.median(samples[n]) for n in ("off", "on"))
        print(f"  {where:<9} {off * 1e3:8.1f} {on * 1e3:8.1f} {on / off:6.2f}x")


def blocks_section(runs: int) -> None:
    layers, heads, dim, block, blocks = 16, 8, 64, 16, 512
    k = torch.randn(layers, blocks * block, heads, dim).to(torch.bfloat16)
    v = torch.randn_like(k)
    per_block = 2 * layers * block * heads * dim * 2

    def zero(b: int) -> None:
        k[:, b * block : (b + 1) * block].zero_()
        v[:, b * block : (b + 1) * block].zero_()

    s = _median_s(lambda: [zero(b) for b in range(128)], runs) / 128
    print(f"\n3. engine KV blocks: zeroing one freed {block}-token block over {layers} layers "
          f"({per_block >> 10} KiB) takes {s * 1e6:.0f} us; a 2048-token request frees 128 blocks: "
          f"{s * 128 * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0, help="KV per transfer")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--skip-remote", action="store_true", help="no StoreServer/RemoteStore row")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cipher_section(args.runs)
    asyncio.run(store_section(args))
    blocks_section(args.runs)


if __name__ == "__main__":
    main()
