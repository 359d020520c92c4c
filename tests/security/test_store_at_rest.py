"""KV at rest in real stores: ciphertext only, tenant- and cache-bound, quarantined when bad, wiped when gone.

The store transport (crossfill.kv.storepull) seals every object with crossfill.security.kv_crypto
before a store sees it; these tests look at what the stores really hold (disk files, memory
buffers, Mooncake Store objects of a real mooncake_master) and at what a pull does with an object
that does not open. The last test runs a real cluster with `transport: store` and the default
`kv_encryption.enabled: true`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from kv.helpers import (
    FINGERPRINT,
    Collector,
    assert_identical,
    build_manifest,
    expectation,
    hybrid_specs,
    make_kv,
)

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.store import EmbeddedStore, StoreUnavailableError
from crossfill.kv.storepull import StorePullReceiver, StorePushSender, object_keys
from crossfill.kv.wire import token_digest
from crossfill.security.audit import AuditLog, verify
from crossfill.security.kv_crypto import AtRest, KVCipher, SealError

pytestmark = pytest.mark.timeout(120)
TOKENS = 64
MASTER = os.urandom(32)
FULL_LAYER = 2  # hybrid_specs: layer 2 is full attention, so every token of it is shipped


def _sealing(audit: AuditLog | None = None) -> AtRest:
    return AtRest(KVCipher([MASTER]), audit=audit)


def _plaintext_windows(kv: dict) -> list[bytes]:
    """32-byte windows of KV that a frame carries verbatim (codec none): K of the full layer."""
    raw = kv[FULL_LAYER][0][:16].numpy().tobytes()
    return [raw[i : i + 32] for i in range(0, len(raw) - 32, 61)]


def _holds_any(blob: bytes, windows: list[bytes]) -> bool:
    return any(w in blob for w in windows)


async def _upload(store, m, kv, at_rest: AtRest | None) -> None:
    async with StorePushSender(store, at_rest=at_rest).open(m) as tx:
        for layer in sorted(kv):
            await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
        await tx.commit()


def _expect(rx: StorePullReceiver, m, sink, tenant: str = "tenant-a", **kw) -> None:
    rx.expect(expectation(m.cache_id, sink, fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS)),
                          tenant=tenant, **kw))


def _disk_files(d: Path) -> list[bytes]:
    return [p.read_bytes() for p in d.glob("*.kv")]


# ------------------------------------------------------------------ embedded store, disk tier


async def test_disk_tier_holds_only_ciphertext_and_the_pull_is_exact(tmp_path: Path) -> None:
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS)
    windows = _plaintext_windows(kv)
    # memory_capacity_bytes=0: every object goes to the disk tier's files.
    plain_dir, sealed_dir = tmp_path / "plain", tmp_path / "sealed"
    with EmbeddedStore(memory_capacity_bytes=0, disk_dir=plain_dir, disk_capacity_bytes=16 << 20) as plain:
        await _upload(plain, build_manifest(specs, TOKENS), kv, None)
        # The control: without sealing the scan does find the KV in the files.
        assert any(_holds_any(f, windows) for f in _disk_files(plain_dir))

    at_rest = _sealing()
    with EmbeddedStore(memory_capacity_bytes=0, disk_dir=sealed_dir, disk_capacity_bytes=16 << 20) as store:
        m = build_manifest(specs, TOKENS)
        await _upload(store, m, kv, at_rest)
        files = _disk_files(sealed_dir)
        assert len(files) == m.frame_count + 2  # manifest, frames, commit: all on disk
        assert not any(_holds_any(f, windows) for f in files)

        sink = Collector()
        rx = StorePullReceiver(store, at_rest=at_rest)
        _expect(rx, m, sink)
        assert await rx.wait(m.cache_id) == m
        assert_identical(m, kv, sink)
        assert rx.counters()["sealed_opened"] == m.frame_count + 2
        assert _disk_files(sealed_dir) == []  # consumed: overwritten and unlinked
        assert store.stats().wiped_bytes >= sum(len(f) for f in files)
        assert at_rest.deletions("consumed") == m.frame_count + 2


def test_expired_objects_are_unreachable_their_memory_zeroed_and_files_gone(tmp_path: Path) -> None:
    now = [1_000.0]
    store = EmbeddedStore(memory_capacity_bytes=64 << 10, disk_dir=tmp_path, disk_capacity_bytes=1 << 20,
                          clock=lambda: now[0])
    small, big = os.urandom(32 << 10), os.urandom(256 << 10)
    store.put("kv/c/f/0", small, ttl_s=10, tenant="t")  # fits memory
    store.put("kv/c/f/1", big, ttl_s=10, tenant="t")  # larger than the memory tier: a disk file
    held = store._index[("t", "kv/c/f/0")].data  # the memory tier's own buffer of the object
    path = store._index[("t", "kv/c/f/1")].path
    assert isinstance(held, bytearray) and bytes(held) == small and path is not None and path.exists()
    got = store.get("kv/c/f/0", tenant="t")
    assert got == small and got is not held  # readers get a copy; the store's buffer stays its own

    now[0] += 11
    assert store.purge_expired() == 2  # what the worker's sweeper runs
    assert store.get("kv/c/f/0", tenant="t") is None and store.get("kv/c/f/1", tenant="t") is None
    assert held == bytearray(len(small))  # zeroed in place before release
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert store.stats().wiped_bytes >= len(small) + len(big)
    assert got == small  # the copy a reader took is the reader's (the store cannot wipe it)

    # Explicit delete, LRU demotion to disk and close() wipe the memory buffer the same way.
    store.put("a", small, tenant="t")
    a = store._index[("t", "a")].data
    assert store.delete("a", tenant="t") and a == bytearray(len(small))
    store.put("b", small, tenant="t")
    b = store._index[("t", "b")].data
    store.put("c", small, tenant="t")
    store.put("d", small, tenant="t")  # memory holds two: "b" moves to disk, its buffer wiped
    assert store._index[("t", "b")].data is None and b == bytearray(len(small))
    c = store._index[("t", "c")].data
    store.close()
    assert c == bytearray(len(small))


# ------------------------------------------------------------------ quarantine


async def test_a_flipped_stored_byte_is_quarantined_counted_audited_and_cleaned(tmp_path: Path) -> None:
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    audit = AuditLog(tmp_path / "decode.jsonl", "decode")
    at_rest = _sealing(audit)
    store = EmbeddedStore(memory_capacity_bytes=16 << 20)
    await _upload(store, m, kv, at_rest)
    _, prefix, _ = object_keys(m.cache_id)
    bad = bytearray(store.get(f"{prefix}2", tenant="tenant-a"))
    bad[len(bad) // 2] ^= 0x04  # one ciphertext bit
    store.put(f"{prefix}2", bytes(bad), tenant="tenant-a")

    sink = Collector()
    rx = StorePullReceiver(store, at_rest=at_rest)
    _expect(rx, m, sink)
    with pytest.raises(TransferError) as info:
        await rx.wait(m.cache_id)
    assert info.value.reason is Reason.CHECKSUM and "quarantined" in info.value.message
    assert sink.calls == 2  # frames 0 and 1 only; the consumer discards them (transfer failed)
    assert rx.counters()["quarantined"] == 1
    assert at_rest.quarantines("auth_failed") == 1
    assert store.stats().objects == 0  # the bad object and the rest of its cache are gone
    records = [json.loads(line) for line in (tmp_path / "decode.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["kv_quarantined", "cache_deleted"]
    assert records[0]["reason"] == "auth_failed" and records[0]["key"] == f"{prefix}2"
    assert records[1]["why"] == "failed" and records[1]["cache_id"] == m.cache_id
    assert verify(tmp_path / "decode.jsonl").ok
    store.close()


@pytest.mark.parametrize("moved_to", ["another tenant", "another cache id"])
async def test_objects_moved_to_another_tenant_or_cache_id_do_not_open(moved_to: str) -> None:
    """What a store bug or an attacker with write access to the store could do: copy sealed objects
    under other names. The manifest would even say the right cache id; the seal does not agree."""
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, cache_id="cache-A")
    at_rest = _sealing()
    store = EmbeddedStore(memory_capacity_bytes=16 << 20)
    await _upload(store, m, kv, at_rest)
    tenant, cache_id = ("tenant-b", "cache-A") if moved_to == "another tenant" else ("tenant-a", "cache-B")
    src, dst = object_keys("cache-A"), object_keys(cache_id)
    for i in range(m.frame_count):
        store.put(f"{dst[1]}{i}", store.get(f"{src[1]}{i}", tenant="tenant-a"), tenant=tenant)
    for s, d in ((src[0], dst[0]), (src[2], dst[2])):
        store.put(d, store.get(s, tenant="tenant-a"), tenant=tenant)
    if moved_to == "another cache id":  # a manifest that names cache-B, sealed as cache-A's would be
        forged = build_manifest(specs, TOKENS, cache_id="cache-B")
        from crossfill.kv.wire import manifest_body

        store.put(dst[0], at_rest.seal(manifest_body(forged), tenant="tenant-a", cache_id="cache-A", key=src[0]),
                  tenant="tenant-a")
    rx = StorePullReceiver(store, at_rest=at_rest)
    rx.expect(expectation(cache_id, Collector(), tenant=tenant))
    with pytest.raises(TransferError) as info:
        await rx.wait(cache_id)
    assert info.value.reason is Reason.CHECKSUM and "auth_failed" in info.value.message
    assert at_rest.quarantines("auth_failed") == 1
    assert not store.exists(dst[0], tenant=tenant)
    store.close()


async def test_a_reader_without_encryption_sees_no_kv_and_a_sealing_reader_refuses_plain_objects() -> None:
    """Both sides must agree on kv_encryption; a mismatch fails the transfer, never feeds wrong bytes."""
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    store = EmbeddedStore(memory_capacity_bytes=16 << 20)
    m = build_manifest(specs, TOKENS, cache_id="plain")
    await _upload(store, m, kv, None)
    at_rest = _sealing()
    rx = StorePullReceiver(store, at_rest=at_rest)
    _expect(rx, m, Collector())
    with pytest.raises(TransferError, match="malformed"):
        await rx.wait("plain")
    assert at_rest.quarantines("malformed") == 1
    store.close()


# ------------------------------------------------------------------ Mooncake Store


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake not importable: {exc}; install the 'mooncake' extra and libibverbs1")
    from crossfill.kv.store.mooncake import MooncakeStore
    from crossfill.kv.store.mooncake_master import MooncakeMaster

    try:
        master = MooncakeMaster(log_dir=tmp_path_factory.mktemp("master")).start()
    except StoreUnavailableError as exc:
        pytest.skip(f"mooncake_master cannot start here: {exc}")
    s = MooncakeStore(master.address, global_segment_bytes=64 << 20, local_buffer_bytes=16 << 20)
    yield s
    s.close()
    master.stop()


@pytest.mark.mooncake
async def test_mooncake_store_objects_are_ciphertext_another_tenant_cannot_open(mooncake) -> None:
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS)
    windows = _plaintext_windows(kv)
    plain = build_manifest(specs, TOKENS, cache_id="mc-plain")
    await _upload(mooncake, plain, kv, None)
    frames = [mooncake._client.get(f"cf/tenant-a/{object_keys('mc-plain')[1]}{i}") for i in range(plain.frame_count)]
    assert any(_holds_any(f, windows) for f in frames)  # control: the scan finds plain KV

    at_rest = _sealing()
    m = build_manifest(specs, TOKENS, cache_id="mc-sealed")
    await _upload(mooncake, m, kv, at_rest)
    manifest_key, prefix, commit_key = object_keys(m.cache_id)
    for key in [manifest_key, commit_key] + [f"{prefix}{i}" for i in range(m.frame_count)]:
        raw = mooncake._client.get(f"cf/tenant-a/{key}")  # the object as the cluster holds it
        assert raw and not _holds_any(raw, windows)
    blob = mooncake.get(f"{prefix}0", tenant="tenant-a")
    other = KVCipher([MASTER])  # the same deployment's key, opened as tenant-b
    with pytest.raises(SealError, match="auth_failed"):
        other.open(blob, tenant="tenant-b", cache_id=m.cache_id, key=f"{prefix}0")

    sink = Collector()
    rx = StorePullReceiver(mooncake, at_rest=at_rest, poll_ms=2)
    _expect(rx, m, sink)
    assert await rx.wait(m.cache_id) == m
    assert_identical(m, kv, sink)
    assert mooncake.get(f"{prefix}0", tenant="tenant-a") is None  # consumed and removed


# ------------------------------------------------------------------ a live cluster


def _generate(url: str, prompt: str, policy: str) -> tuple[list[int], dict]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "prefill_policy": policy}
    r = httpx.post(url + "/v1/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"], r.json()["crossfill"]


@pytest.mark.timeout(600)
def test_store_transport_with_encryption_serves_the_local_routes_tokens(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from serving.serving_cluster import launch_cluster

    prompt = "Sealed KV crosses the store and decodes the same tokens. " * 10
    kv = {"transport": "store", "store": "embedded", "store_memory_mb": 64}
    with launch_cluster(str(tiny_llama_dir), tmp_path, kv_cache=kv) as c:
        assert c.cfg.security.kv_encryption.enabled  # the default, as deployed
        local, info = _generate(c.url, prompt, "local_only")
        assert info["route"] == "local"
        remote, info = _generate(c.url, prompt, "remote_required")
        assert info["route"] == "remote" and info["retries"] == 0 and info["transport"] == "store", info
        assert remote == local
        stats = httpx.get(c.worker_url("here-decode-0") + "/v1/admin/stats", timeout=10).json()
        transfers = stats["transfers"]
        assert transfers["sealed_opened"] > 0 and transfers.get("quarantined", 0) == 0, transfers
        metrics = httpx.get(c.worker_url("here-decode-0") + "/metrics", timeout=10).text
        assert 'crossfill_kv_deleted_objects_total{why="consumed"}' in metrics
