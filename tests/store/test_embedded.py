"""Behaviour of the embedded KV store that store-and-pull transfer relies on."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from crossfill.kv.store import (
    AsyncKVStore,
    EmbeddedStore,
    InvalidArgumentError,
    InvalidKeyError,
    KVStore,
    ObjectTooLargeError,
    StoreError,
    WatchableKVStore,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_is_a_kvstore_and_round_trips(tmp_path):
    store = EmbeddedStore(memory_capacity_bytes=1000, disk_dir=tmp_path, disk_capacity_bytes=1000)
    assert isinstance(store, KVStore)
    store.put("cache-1", b"hello", tenant="a")
    assert store.get("cache-1", tenant="a") == b"hello"
    assert store.exists("cache-1", tenant="a")
    store.put("cache-1", bytearray(b"replaced"), tenant="a")
    assert store.get("cache-1", tenant="a") == b"replaced"
    assert store.delete("cache-1", tenant="a") is True
    assert store.delete("cache-1", tenant="a") is False
    assert store.get("cache-1", tenant="a") is None
    s = store.stats()
    assert (s.puts, s.hits, s.misses, s.deletes, s.objects, s.memory_bytes) == (2, 2, 1, 1, 0, 0)


def test_tenant_isolation():
    store = EmbeddedStore(memory_capacity_bytes=1000)
    store.put("k", b"secret-of-a", tenant="tenant-a")
    assert store.get("k", tenant="tenant-b") is None
    assert not store.exists("k", tenant="tenant-b")
    assert store.delete("k", tenant="tenant-b") is False
    store.put("k", b"b's own", tenant="tenant-b")
    assert store.get("k", tenant="tenant-a") == b"secret-of-a"
    assert store.get("k", tenant="tenant-b") == b"b's own"


def test_expired_entries_are_unreachable_and_their_files_deleted(tmp_path):
    clock = FakeClock()
    store = EmbeddedStore(memory_capacity_bytes=0, disk_dir=tmp_path, disk_capacity_bytes=10_000, clock=clock)
    store.put("short", b"x" * 100, ttl_s=5)
    store.put("long", b"y" * 100, ttl_s=50)
    assert len(list(tmp_path.glob("*.kv"))) == 2
    clock.now += 6
    assert store.get("short") is None
    assert not store.exists("short")
    assert store.get("long") == b"y" * 100
    assert len(list(tmp_path.glob("*.kv"))) == 1
    clock.now += 100
    assert store.purge_expired() == 1
    assert list(tmp_path.glob("*.kv")) == []
    assert store.stats().expirations == 2
    assert store.stats().disk_bytes == 0


def test_background_sweeper_deletes_expired_files_without_access(tmp_path):
    with EmbeddedStore(
        memory_capacity_bytes=0, disk_dir=tmp_path, disk_capacity_bytes=1000, sweep_interval_s=0.05
    ) as store:
        store.put("k", b"z" * 10, ttl_s=0.1)
        assert len(list(tmp_path.glob("*.kv"))) == 1
        deadline = time.monotonic() + 60  # a safety net: the sweeper runs every 50 ms
        while list(tmp_path.glob("*.kv")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert list(tmp_path.glob("*.kv")) == []


def test_lru_demotes_to_disk_then_evicts(tmp_path):
    store = EmbeddedStore(memory_capacity_bytes=250, disk_dir=tmp_path, disk_capacity_bytes=250)
    for name in "abcd":
        store.put(name, name.encode() * 100)
        if name == "b":
            assert store.get("a") is not None  # 'a' becomes most recently used; 'b' is now LRU
    # memory holds 2 objects, disk 2: after 4 puts everything is still present.
    s = store.stats()
    assert (s.memory_bytes, s.disk_bytes, s.evictions) == (200, 200, 0)
    store.put("e", b"e" * 100)  # memory full -> demote LRU; disk full -> evict disk's LRU ('b')
    assert store.get("b") is None
    for name in "acde":
        assert store.get(name) == name.encode() * 100
    assert store.stats().evictions == 1


def test_memory_only_store_evicts_lru():
    store = EmbeddedStore(memory_capacity_bytes=300)
    for name in "abc":
        store.put(name, b"." * 100)
    store.get("a")
    store.put("d", b"." * 100)
    assert store.get("b") is None
    assert all(store.exists(n) for n in "acd")


def test_object_larger_than_capacity_is_refused_clearly(tmp_path):
    store = EmbeddedStore(memory_capacity_bytes=100, disk_dir=tmp_path, disk_capacity_bytes=200)
    store.put("fits-on-disk", b"x" * 150)  # too big for memory, goes straight to disk
    assert store.get("fits-on-disk") == b"x" * 150
    with pytest.raises(ObjectTooLargeError, match=r"201 bytes.*at most 200.*raise a capacity"):
        store.put("huge", b"x" * 201)
    assert store.get("fits-on-disk") == b"x" * 150  # a refused put evicts nothing


def test_disk_tier_survives_restart_and_drops_expired(tmp_path):
    clock = FakeClock()
    first = EmbeddedStore(memory_capacity_bytes=0, disk_dir=tmp_path, disk_capacity_bytes=1000, clock=clock)
    first.put("keep", b"K" * 10, ttl_s=100, tenant="t1")
    first.put("drop", b"D" * 10, ttl_s=1, tenant="t1")
    first.close()
    clock.now += 10
    second = EmbeddedStore(memory_capacity_bytes=0, disk_dir=tmp_path, disk_capacity_bytes=1000, clock=clock)
    assert second.get("keep", tenant="t1") == b"K" * 10
    assert second.get("keep", tenant="t2") is None
    assert second.get("drop", tenant="t1") is None
    assert len(list(tmp_path.glob("*.kv"))) == 1


def test_secure_delete_zeroes_file_before_unlink(tmp_path, monkeypatch):
    store = EmbeddedStore(memory_capacity_bytes=0, disk_dir=tmp_path, disk_capacity_bytes=1000)
    store.put("k", b"SECRET" * 10)
    (path,) = tmp_path.glob("*.kv")
    assert path.stat().st_mode & 0o777 == 0o600  # other local users cannot read cached KV
    seen: list[bytes] = []
    real_unlink = type(path).unlink

    def spy_unlink(self, *a, **kw):
        seen.append(self.read_bytes())
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr(type(path), "unlink", spy_unlink)
    store.delete("k")
    assert seen and b"SECRET" not in seen[0] and set(seen[0]) == {0}


def test_bad_input_errors_name_the_problem():
    store = EmbeddedStore(memory_capacity_bytes=100)
    with pytest.raises(InvalidKeyError, match="tenant"):
        store.put("k", b"v", tenant="a/b")
    with pytest.raises(InvalidKeyError, match="non-empty"):
        store.get("")
    with pytest.raises(InvalidKeyError, match="too long"):
        store.exists("k" * 600)
    with pytest.raises(InvalidArgumentError, match="ttl_s"):
        store.put("k", b"v", ttl_s=0)
    with pytest.raises(InvalidArgumentError, match="disk_capacity_bytes"):
        EmbeddedStore(disk_dir="/tmp/nowhere-used", disk_capacity_bytes=0)
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("k")


async def test_async_adapter_does_not_block_loop():
    store = AsyncKVStore(EmbeddedStore(memory_capacity_bytes=1 << 20))
    await asyncio.gather(*(store.put(f"k{i}", bytes([i]) * 10, tenant="t") for i in range(20)))
    values = await asyncio.gather(*(store.get(f"k{i}", tenant="t") for i in range(20)))
    assert values == [bytes([i]) * 10 for i in range(20)]
    assert await store.exists("k3", tenant="t")
    assert await store.delete("k3", tenant="t")
    assert (await store.stats()).objects == 19
    await store.close()


# ---------------------------------------------------------------------------- change notification


def test_watch_reports_puts_of_matching_tenant_and_prefix_only():
    store = EmbeddedStore(memory_capacity_bytes=10_000)
    assert isinstance(store, WatchableKVStore)
    seen: list[tuple[str, bytes | None]] = []
    # The callback may read the store: the value is visible and no store lock is held.
    watch = store.watch("kv/a/", lambda key: seen.append((key, store.get(key, tenant="t1"))), tenant="t1")
    everything: list[str] = []
    store.watch("", everything.append, tenant="t1")
    store.put("kv/a/x", b"1", tenant="t1")
    store.put("kv/ab/x", b"2", tenant="t1")  # a different prefix that merely starts alike
    store.put("kv/a/x", b"3", tenant="t2")  # another tenant's key of the same name
    store.put("kv/a/", b"4", tenant="t1")  # the prefix itself is a key under it
    store.delete("kv/a/x", tenant="t1")  # only puts are reported
    assert seen == [("kv/a/x", b"1"), ("kv/a/", b"4")]
    assert everything == ["kv/a/x", "kv/ab/x", "kv/a/"]
    watch.close()
    watch.close()  # idempotent
    store.put("kv/a/y", b"5", tenant="t1")
    assert len(seen) == 2 and store.watch_count() == 1


def test_put_from_another_thread_wakes_a_waiting_thread_promptly():
    store = EmbeddedStore(memory_capacity_bytes=10_000)
    landed = threading.Event()
    put_done: list[float] = []
    woke: list[float] = []

    def on_put(key: str) -> None:
        woke.append(time.monotonic())
        landed.set()

    def writer() -> None:
        time.sleep(0.05)
        store.put("kv/c/commit", b"done", tenant="t")
        put_done.append(time.monotonic())

    with store.watch("kv/c/", on_put, tenant="t"):
        t = threading.Thread(target=writer)
        t.start()
        assert landed.wait(60), "the put on another thread did not wake the waiter"
        t.join()
    assert store.watch_count() == 0
    assert woke[0] <= put_done[0]  # called by the put itself, before it returned


def test_concurrent_puts_and_watches_lose_nothing_and_leak_nothing():
    store = EmbeddedStore(memory_capacity_bytes=1 << 20)
    counts = {i: 0 for i in range(4)}
    lock = threading.Lock()

    def bump(i: int):
        def cb(key: str) -> None:
            with lock:
                counts[i] += 1
        return cb

    watches = [store.watch(f"kv/{i}/", bump(i), tenant="t") for i in range(4)]

    def writer(i: int) -> None:
        for n in range(200):
            store.put(f"kv/{i}/f/{n}", b"x", tenant="t")

    def churn() -> None:  # unrelated watches come and go while the writers run
        for n in range(200):
            store.watch(f"kv/other-{n}/", lambda key: None, tenant="t").close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {i: 200 for i in range(4)}
    for w in watches:
        w.close()
    assert store.watch_count() == 0


def test_failing_callback_does_not_fail_the_put_and_close_ends_watches(caplog):
    store = EmbeddedStore(memory_capacity_bytes=1000)

    def broken(key: str) -> None:
        raise RuntimeError("listener bug")

    store.watch("k", broken)
    with caplog.at_level(logging.ERROR):
        store.put("k1", b"v")
    assert store.get("k1") == b"v"
    assert "watch callback" in caplog.text
    with pytest.raises(InvalidKeyError, match="prefix"):
        store.watch("bad\n", broken)
    store.close()
    assert store.watch_count() == 0
    with pytest.raises(StoreError, match="closed"):
        store.watch("k", broken)
