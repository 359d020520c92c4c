"""The network-reachable store: StoreServer serving a local store, RemoteStore as its KVStore client."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest
import torch

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.assembler import Expectation
from crossfill.kv.store import EmbeddedStore, InvalidKeyError, KVStore, StoreUnavailableError
from crossfill.kv.store.remote import RemoteStore, StoreServer
from crossfill.kv.storepull import StorePullReceiver, StorePushSender
from crossfill.kv.tls import client_context, server_context, write_dev_pki
from crossfill.kv.wire import Manifest, token_digest

pytestmark = pytest.mark.timeout(60)


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def _call(fn, *args):
    """Client calls run in a worker thread: the server shares this test's event loop."""
    return await asyncio.to_thread(fn, *args)


async def test_put_get_delete_exists_stats_round_trip() -> None:
    local = EmbeddedStore(memory_capacity_bytes=1 << 20)
    async with StoreServer(local) as server:
        with RemoteStore(server.address) as remote:
            assert isinstance(remote, KVStore)
            await _call(remote.put, "a", b"x" * 1000)
            assert await _call(remote.get, "a") == b"x" * 1000
            assert local.get("a") == b"x" * 1000  # it landed in the served store
            assert await _call(remote.exists, "a")
            assert not await _call(remote.exists, "b")
            assert await _call(remote.get, "b") is None
            await _call(remote.put, "empty", b"")
            assert await _call(remote.get, "empty") == b""
            stats = await _call(remote.stats)
            assert stats.objects == 2 and stats.puts == 2 and stats.hits == 3 and stats.misses == 1
            assert await _call(remote.delete, "a")
            assert not await _call(remote.delete, "a")
            assert await _call(remote.get, "a") is None
        assert server.counters()["requests"] == 11
    local.close()


async def test_tenants_are_isolated_and_ttl_expires() -> None:
    clock = _Clock()
    local = EmbeddedStore(memory_capacity_bytes=1 << 20, clock=clock)
    async with StoreServer(local) as server:
        with RemoteStore(server.address) as remote:
            await _call(remote.put, "k", b"alpha", None, "tenant-a")
            assert await _call(remote.get, "k", "tenant-b") is None
            assert not await _call(remote.exists, "k", "tenant-b")
            assert not await _call(remote.delete, "k", "tenant-b")
            assert await _call(remote.get, "k", "tenant-a") == b"alpha"
            await _call(remote.put, "short", b"lived", 5.0, "tenant-a")
            assert await _call(remote.get, "short", "tenant-a") == b"lived"
            clock.now += 6
            assert await _call(remote.get, "short", "tenant-a") is None
            assert await _call(remote.get, "k", "tenant-a") == b"alpha"  # default TTL still running
    local.close()


async def test_bad_requests_get_an_error_answer_are_counted_and_the_server_keeps_serving() -> None:
    local = EmbeddedStore(memory_capacity_bytes=1 << 20)
    async with StoreServer(local, max_object_bytes=1 << 16) as server:
        with RemoteStore(server.address) as remote:
            with pytest.raises(InvalidKeyError):  # checked by the client before anything is sent
                await _call(remote.put, "", b"x")

            def raw(request: bytes) -> bytes:
                """Send raw bytes, return the one answer (header and body)."""
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                    s.sendall(request)
                    answer = b""
                    while len(answer) < 14 or len(answer) < 14 + struct.unpack("!Q", answer[6:14])[0]:
                        chunk = s.recv(65536)
                        assert chunk, f"connection closed after {answer!r}"
                        answer += chunk
                    return answer

            garbage = await _call(raw, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert garbage[:4] == b"CXST" and garbage[5] == 2 and b"not a crossfill store request" in garbage
            # A body length far beyond the limit is refused before anything is allocated or read.
            huge = struct.pack("!4sBBHHdQ", b"CXST", 1, 1, 7, 1, float("nan"), 1 << 40) + b"defaultk"
            answer = await _call(raw, huge)
            assert answer[5] == 2 and b"exceeds the limits" in answer
            # The server names store errors: a key the store refuses (non-printable) reaches it raw.
            bad_key = struct.pack("!4sBBHHdQ", b"CXST", 1, 2, 7, 1, float("nan"), 0) + b"default\x01"
            assert b"InvalidKeyError" in await _call(raw, bad_key)
            await _call(remote.put, "still", b"serving")
            assert await _call(remote.get, "still") == b"serving"
        counters = server.counters()
    assert counters["refused_malformed"] == 1 and counters["refused_oversized"] == 1
    assert counters["errors_InvalidKeyError"] == 1
    local.close()


async def test_push_through_the_server_and_pull_locally_woken_by_the_watch() -> None:
    """The intended deployment: prefill pushes to decode's StoreServer; decode pulls from its embedded store."""
    specs = [LayerSpec(i, "full", None, 2, 32, torch.float32) for i in range(4)]
    tokens = 100
    g = torch.Generator().manual_seed(0)
    kv = {s.index: (torch.randn(tokens, 2, 32, generator=g), torch.randn(tokens, 2, 32, generator=g)) for s in specs}
    m = Manifest.build(cache_id="remote-1", request_id="r", tenant="tenant-a", fingerprint="f" * 64,
                       token_ids=list(range(tokens)), layer_specs=specs, codec="fp8+zstd", frame_tokens=16, ttl_s=60)
    got: list[LayerKVChunk] = []
    local = EmbeddedStore(memory_capacity_bytes=64 << 20)
    async with StoreServer(local) as server, StorePullReceiver(local) as rx:
        rx.expect(Expectation(m.cache_id, got.append, fingerprint="f" * 64, token_digest=token_digest(range(tokens)),
                              tenant="tenant-a", timeout_s=10))
        sender = StorePushSender(RemoteStore(server.address), owns_store=True)
        async with sender.open(m) as tx:
            for layer in sorted(kv):
                await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
            stats = await tx.commit()
        await sender.close()
        assert await rx.wait(m.cache_id) == m
        assert rx.transfer_bytes(m.cache_id) == (stats.raw_bytes, stats.wire_bytes)
        counters = rx.counters()
    assert len(got) == m.frame_count == stats.frames
    # Woken by the store's watch as the server's puts landed, not by polling: at most a read
    # before each object landed and one after.
    assert counters["store_gets"] <= 2 * (m.frame_count + 2)
    assert local.stats().objects == 0  # consumed objects are deleted
    local.close()


async def test_server_gone_raises_store_unavailable_naming_the_address() -> None:
    local = EmbeddedStore(memory_capacity_bytes=1 << 20)
    server = await StoreServer(local).start()
    remote = RemoteStore(server.address, timeout_s=2)
    await _call(remote.put, "k", b"v")  # leaves an idle pooled connection
    address = server.address
    await server.close()
    with pytest.raises(StoreUnavailableError, match=address.replace("[", r"\[").replace(".", r"\.")):
        await _call(remote.get, "k")
    # A server back on the same port: the client reconnects by itself.
    async with StoreServer(local, port=int(address.rsplit(":", 1)[1])):
        assert await _call(remote.get, "k") == b"v"
    remote.close()
    local.close()


async def test_many_threads_share_one_client() -> None:
    local = EmbeddedStore(memory_capacity_bytes=16 << 20)
    async with StoreServer(local) as server:
        with RemoteStore(server.address, pool_size=4) as remote:
            errors: list[BaseException] = []

            def worker(i: int) -> None:
                try:
                    for j in range(20):
                        remote.put(f"t{i}/{j}", bytes([i]) * (1000 + j))
                        assert remote.get(f"t{i}/{j}") == bytes([i]) * (1000 + j)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            def run_all() -> None:
                threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            await asyncio.to_thread(run_all)
            assert not errors, errors
            assert (await _call(remote.stats)).objects == 160
    local.close()


async def test_mutual_tls_round_trip_and_a_client_without_the_ca_is_refused(tmp_path) -> None:
    pki = write_dev_pki(tmp_path / "pki")
    rogue = write_dev_pki(tmp_path / "rogue")  # a client certificate from another CA
    local = EmbeddedStore(memory_capacity_bytes=1 << 20)
    tls = server_context(pki["server_cert"], pki["server_key"], pki["ca"])
    async with StoreServer(local, tls=tls) as server:
        good = RemoteStore(server.address, tls=client_context(pki["ca"], pki["client_cert"], pki["client_key"]))
        await _call(good.put, "secret", b"kv", None, "tenant-a")
        assert await _call(good.get, "secret", "tenant-a") == b"kv"
        good.close()
        rogue_client = RemoteStore(server.address, timeout_s=2,
                                   tls=client_context(pki["ca"], rogue["client_cert"], rogue["client_key"]))
        with pytest.raises(StoreUnavailableError, match=server.address):
            await _call(rogue_client.get, "secret", "tenant-a")
        rogue_client.close()
        plain = RemoteStore(server.address, timeout_s=2)
        with pytest.raises(StoreUnavailableError):
            await _call(plain.get, "secret", "tenant-a")
        plain.close()
    local.close()
