"""MooncakeStore against a real mooncake_master started on loopback by the fixture."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time

import pytest

from crossfill.kv.store import (
    KVStore,
    ObjectTooLargeError,
    StoreError,
    StoreUnavailableError,
    WatchableKVStore,
)

from .conftest import needs_mooncake

pytestmark = [pytest.mark.mooncake, needs_mooncake, pytest.mark.timeout(120)]

MB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def store(mooncake_master):
    from crossfill.kv.store.mooncake import MooncakeStore

    s = MooncakeStore(mooncake_master.address, global_segment_bytes=64 * MB, local_buffer_bytes=16 * MB)
    yield s
    s.close()


def test_round_trip_replace_delete(store):
    assert isinstance(store, KVStore)
    assert not isinstance(store, WatchableKVStore)  # no watch API: store-and-pull polls it
    store.put("rt", b"first", tenant="t1")
    assert store.get("rt", tenant="t1") == b"first"
    store.put("rt", b"second value", tenant="t1")  # replaces (Mooncake's own put would not)
    assert store.get("rt", tenant="t1") == b"second value"
    assert store.exists("rt", tenant="t1")
    assert store.delete("rt", tenant="t1") is True
    assert store.delete("rt", tenant="t1") is False
    assert store.get("rt", tenant="t1") is None and not store.exists("rt", tenant="t1")
    big = bytes(range(256)) * (8 * MB // 256)
    store.put("big", big, tenant="t1")
    assert store.get("big", tenant="t1") == big
    store.delete("big", tenant="t1")


def test_tenant_isolation(store):
    store.put("shared-name", b"A's KV", tenant="tenant-a")
    assert store.get("shared-name", tenant="tenant-b") is None
    assert not store.exists("shared-name", tenant="tenant-b")
    assert store.delete("shared-name", tenant="tenant-b") is False
    assert store.get("shared-name", tenant="tenant-a") == b"A's KV"
    store.delete("shared-name", tenant="tenant-a")


def test_ttl_expiry_makes_objects_unreachable_and_removes_them(mooncake_master):
    from crossfill.kv.store.mooncake import MooncakeStore

    clock = FakeClock()
    with (
        MooncakeStore(
            mooncake_master.address, global_segment_bytes=16 * MB, local_buffer_bytes=4 * MB, clock=clock
        ) as s,
        MooncakeStore(mooncake_master.address, global_segment_bytes=0, local_buffer_bytes=4 * MB) as other,
    ):
        s.put("short", b"s" * 1000, ttl_s=5)
        s.put("unread", b"u" * 1000, ttl_s=5)
        s.put("long", b"l" * 1000, ttl_s=500)
        assert other.get("short") == b"s" * 1000
        clock.now += 6
        assert s.get("short") is None and not s.exists("unread")
        assert other.get("short") is None  # removed from the cluster, not just hidden locally
        s.put("trigger", b"t", ttl_s=500)
        assert s.stats().expirations >= 2
        assert other.get("unread") is None
        assert s.get("long") == b"l" * 1000
        assert s.stats().objects == 2  # long + trigger


def test_expired_object_is_refused_by_a_reader_in_another_process(store, mooncake_master):
    payload = hashlib.sha256(b"seed").digest() * 1000
    store.put("fresh", payload, ttl_s=60, tenant="x")
    store.put("stale", payload, ttl_s=0.5, tenant="x")
    time.sleep(0.6)
    reader = textwrap.dedent(f"""
        import hashlib
        from crossfill.kv.store.mooncake import MooncakeStore
        with MooncakeStore({mooncake_master.address!r}, global_segment_bytes=0, local_buffer_bytes=4 << 20) as s:
            fresh = s.get("fresh", tenant="x")
            print("fresh", hashlib.sha256(fresh).hexdigest() if fresh else None)
            print("stale", s.get("stale", tenant="x"))
            print("other-tenant", s.get("fresh", tenant="y"))
    """)
    out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines == {"fresh": hashlib.sha256(payload).hexdigest(), "stale": "None", "other-tenant": "None"}


def test_object_larger_than_the_client_buffer_is_refused(store):
    with pytest.raises(ObjectTooLargeError, match="local_buffer_bytes"):
        store.put("too-big", b"x" * (16 * MB))


def test_unreachable_master_fails_fast_with_a_clear_error():
    from crossfill.kv.store.mooncake import MooncakeStore
    from crossfill.kv.store.mooncake_master import free_port

    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="cannot reach mooncake_master"):
        MooncakeStore(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 10


def test_closed_client_refuses(mooncake_master):
    from crossfill.kv.store.mooncake import MooncakeStore

    s = MooncakeStore(mooncake_master.address, global_segment_bytes=0, local_buffer_bytes=MB)
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.get("k")
