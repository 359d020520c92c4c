"""Store-and-pull: prefill lands frames in a KV store, decode pulls and verifies them the same way as TCP."""

from __future__ import annotations

import asyncio

import pytest

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.store import EmbeddedStore
from crossfill.kv.storepull import StorePullReceiver, StorePushSender, object_keys
from crossfill.kv.wire import token_digest

from .helpers import FINGERPRINT, Collector, assert_identical, build_manifest, hybrid_specs, make_kv

pytestmark = pytest.mark.timeout(60)
TOKENS = 100


def _mooncake_missing() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def mooncake_store(tmp_path_factory):
    """One real mooncake_master and client for the module (starting one takes seconds)."""
    missing = _mooncake_missing()
    if missing:
        pytest.skip(f"mooncake not importable: {missing}")
    from crossfill.kv.store.mooncake import MooncakeStore
    from crossfill.kv.store.mooncake_master import MooncakeMaster

    master = MooncakeMaster(log_dir=tmp_path_factory.mktemp("master")).start()
    s = MooncakeStore(master.address, global_segment_bytes=64 << 20, local_buffer_bytes=16 << 20)
    yield s
    s.close()
    master.stop()


@pytest.fixture(params=["embedded", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store(request):
    if request.param == "mooncake":
        yield request.getfixturevalue("mooncake_store")
        return
    s = EmbeddedStore(memory_capacity_bytes=64 << 20)
    yield s
    s.close()


def _expect(rx: StorePullReceiver, m, sink, **kw) -> None:
    rx.expect(m.cache_id, sink, fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS)),
              tenant="tenant-a", **kw)


async def _upload(store, m, kv, delay: float = 0.0):
    async with StorePushSender(store).open(m) as tx:
        for layer in sorted(kv):
            await asyncio.sleep(delay)
            await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
        return await tx.commit()


@pytest.mark.parametrize("codec", ["none", "fp8+zstd"])
async def test_pull_overlaps_upload_and_is_verified(store, codec: str) -> None:
    specs = hybrid_specs()
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, codec=codec)
    sink = Collector()
    rx = StorePullReceiver(store, poll_ms=2)
    _expect(rx, m, sink)  # decode starts pulling before prefill wrote anything
    stats = await _upload(store, m, kv, delay=0.01)
    assert (await rx.wait(m.cache_id)) == m
    if codec == "none":
        assert_identical(m, kv, sink)
    assert sink.calls == m.frame_count == stats.frames
    assert rx.counters()["transfers_completed"] == 1
    manifest_key, prefix, commit_key = object_keys(m.cache_id)
    assert not store.exists(commit_key, tenant="tenant-a")  # consumed objects are deleted
    assert not store.exists(f"{prefix}0", tenant="tenant-a")


async def test_corrupted_stored_frame_is_refused_and_the_bad_cache_removed(store) -> None:
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    await _upload(store, m, kv)
    _, prefix, commit_key = object_keys(m.cache_id)
    bad = bytearray(store.get(f"{prefix}2", tenant="tenant-a"))
    bad[-3] ^= 0x10
    store.put(f"{prefix}2", bytes(bad), tenant="tenant-a")
    sink = Collector()
    rx = StorePullReceiver(store)
    _expect(rx, m, sink)
    with pytest.raises(TransferError) as info:
        await rx.wait(m.cache_id)
    assert info.value.reason is Reason.CHECKSUM
    assert sink.calls == 2  # frames 0 and 1 only; the consumer is told to discard them
    assert rx.counters()["refused_checksum"] == 1
    assert not store.exists(commit_key, tenant="tenant-a")


async def test_pull_refuses_wrong_model_expired_and_missing_commit(store) -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, cache_id="other-model")
    await _upload(store, m, kv)
    sink = Collector()
    rx = StorePullReceiver(store)
    rx.expect(m.cache_id, sink, fingerprint="0" * 64, tenant="tenant-a")
    with pytest.raises(TransferError) as info:
        await rx.wait(m.cache_id)
    assert info.value.reason is Reason.FINGERPRINT_MISMATCH

    expired = build_manifest(specs, TOKENS, cache_id="expired", ttl_s=0.3)
    await _upload(store, expired, kv)  # objects live at least 1 s in the store; the manifest 0.3 s
    await asyncio.sleep(0.35)
    _expect(rx, expired, sink, timeout_ms=500)
    with pytest.raises(TransferError) as info:
        await rx.wait("expired")
    assert info.value.reason is Reason.EXPIRED

    stalled = build_manifest(specs, TOKENS, cache_id="stalled")
    _expect(rx, stalled, sink, timeout_ms=400)
    async with StorePushSender(store).open(stalled) as tx:
        await tx.send(LayerKVChunk(0, 0, *kv[0]))
        with pytest.raises(TransferError) as info:
            await rx.wait("stalled")  # prefill never finishes: decode gives up on its deadline
        assert info.value.reason is Reason.TIMEOUT
        await tx.abort("test")
    assert sink.calls == 0 or all(c.layer == 0 for c in sink.chunks.values())


async def test_aborted_upload_leaves_nothing_and_tenants_are_isolated(store) -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, cache_id="aborted")
    with pytest.raises(RuntimeError):
        async with StorePushSender(store).open(m) as tx:
            await tx.send(LayerKVChunk(0, 0, *kv[0]))
            raise RuntimeError("prefill failed")
    manifest_key, prefix, _ = object_keys("aborted")
    assert not store.exists(manifest_key, tenant="tenant-a") and not store.exists(f"{prefix}0", tenant="tenant-a")

    m2 = build_manifest(specs, TOKENS, cache_id="tenant-a-only")
    await _upload(store, m2, kv)
    rx = StorePullReceiver(store, delete_after_pull=False)
    rx.expect("tenant-a-only", Collector(), tenant="tenant-b", timeout_ms=300)
    with pytest.raises(TransferError) as info:
        await rx.wait("tenant-a-only")
    assert info.value.reason is Reason.TIMEOUT  # another tenant's KV is invisible, not readable
