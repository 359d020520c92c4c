"""Mooncake Transfer Engine backend: frames move one-sided by TE, control and verification as over TCP."""

from __future__ import annotations

import pytest

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.wire import max_frame_body, token_digest

from .helpers import FINGERPRINT, Collector, assert_identical, build_manifest, hybrid_specs, make_kv

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(90)]
TOKENS = 120


@pytest.fixture(scope="module")
def engines():
    try:
        from crossfill.kv.mooncake_te import MooncakeTransferEngine, MooncakeUnavailableError
    except ImportError as exc:  # pragma: no cover - the wrapper module is part of this repo
        pytest.skip(str(exc))
    try:
        return MooncakeTransferEngine(), MooncakeTransferEngine()
    except MooncakeUnavailableError as exc:
        pytest.skip(str(exc))


async def _send(sender, m, kv):
    async with sender.open(m) as tx:
        for layer in sorted(kv):
            await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
        return await tx.commit()


@pytest.mark.parametrize("codec", ["none", "int8+lz4"])
async def test_round_trip_through_a_small_ring(engines, codec: str) -> None:
    from crossfill.kv.te_backend import TEReceiver, TESender

    send_engine, recv_engine = engines
    specs = hybrid_specs(n=6, heads=2, dim=32)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, codec=codec)
    sink = Collector()
    # A region of ~3 frames: the sender must wrap around and wait for answers to free space.
    region = 3 * max_frame_body(m)
    async with TEReceiver(recv_engine, region_bytes=region) as rx:
        rx.expect(m.cache_id, sink, fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS)))
        stats = await _send(TESender(rx.endpoint, send_engine), m, kv)
        assert (await rx.wait(m.cache_id)) == m
    assert stats.frames == m.frame_count > 3
    assert sink.calls == m.frame_count
    if codec == "none":
        assert_identical(m, kv, sink)


async def test_refusals_and_plain_tcp_receiver_reject_frame_refs(engines) -> None:
    from crossfill.kv.tcp import KVReceiver
    from crossfill.kv.te_backend import TEReceiver, TESender

    send_engine, recv_engine = engines
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    async with TEReceiver(recv_engine) as rx:
        with pytest.raises(TransferError) as info:
            await _send(TESender(rx.endpoint, send_engine), m, kv)
        assert info.value.reason is Reason.UNKNOWN_CACHE_ID
        sink = Collector()
        rx.expect(m.cache_id, sink, fingerprint="0" * 64)
        with pytest.raises(TransferError) as info:
            await _send(TESender(rx.endpoint, send_engine), m, kv)
        assert info.value.reason is Reason.FINGERPRINT_MISMATCH
        assert sink.calls == 0
    async with KVReceiver() as plain:
        plain.expect(m.cache_id, Collector())
        with pytest.raises(TransferError):  # a TCP receiver gives no TE region: the sender cannot start
            await _send(TESender(plain.endpoint, send_engine, max_retry=0), m, kv)


_RECEIVER_PROCESS = """
import asyncio, hashlib, sys
import torch
from crossfill.kv.mooncake_te import MooncakeTransferEngine
from crossfill.kv.te_backend import TEReceiver

async def main():
    seen = {}
    def sink(chunk):
        seen[(chunk.layer, chunk.start)] = chunk
    async with TEReceiver(MooncakeTransferEngine(), region_bytes=1 << 20) as rx:
        rx.expect(sys.argv[1], sink, fingerprint=sys.argv[2])
        print(rx.port, flush=True)
        await rx.wait(sys.argv[1])
    h = hashlib.sha256()
    for key in sorted(seen):
        h.update(seen[key].k.numpy().tobytes() + seen[key].v.numpy().tobytes())
    print(len(seen), h.hexdigest(), flush=True)

asyncio.run(main())
"""


async def test_between_two_processes(engines) -> None:
    """The receiver in another process (its own Mooncake TE engine): KV arrives bit-identical."""
    import asyncio
    import hashlib
    import sys

    from crossfill.kv.te_backend import TESender

    send_engine, _ = engines
    specs = hybrid_specs(n=4, heads=2, dim=32)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, cache_id="two-process")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _RECEIVER_PROCESS, m.cache_id, FINGERPRINT,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        port = int((await asyncio.wait_for(proc.stdout.readline(), 60)).decode())
        stats = await _send(TESender(("127.0.0.1", port), send_engine), m, kv)
        frames, digest = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
    finally:
        if proc.returncode is None:
            await asyncio.wait_for(proc.wait(), 30)
    expected = hashlib.sha256()
    for seq in range(m.frame_count):
        entry, start, end = m.slot(seq)
        k, v = kv[entry.index]
        expected.update(k[start:end].numpy().tobytes() + v[start:end].numpy().tobytes())
    assert int(frames) == m.frame_count == stats.frames
    assert digest == expected.hexdigest()
