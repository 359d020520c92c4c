"""The factories: every transport is built by name and answers the same receive interface."""

from __future__ import annotations

import socket

import pytest

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Expectation
from crossfill.kv.backend import ReceiveBackend, TransferBackend
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.sender import parse_endpoint
from crossfill.kv.store import EmbeddedStore
from crossfill.kv.tls import client_context, server_context
from crossfill.kv.transports import (
    TRANSPORTS,
    check_available,
    close_shared,
    make_receiver,
    make_sender,
    make_te_engine,
    open_shared,
)
from crossfill.kv.wire import token_digest

from .helpers import FINGERPRINT, Collector, assert_identical, build_manifest, hybrid_specs, make_kv

pytestmark = pytest.mark.timeout(60)
TOKENS = 90


@pytest.fixture(scope="module")
def te_engine():
    from crossfill.kv.mooncake_te import MooncakeTEError

    try:
        return make_te_engine()
    except MooncakeTEError as exc:  # MooncakeUnavailableError included: says what to install
        pytest.skip(str(exc))


def test_unknown_transport_names_the_valid_ones() -> None:
    for make in (lambda: make_sender("rdma", endpoint=("127.0.0.1", 1)), lambda: make_receiver("rdma")):
        with pytest.raises(ValueError, match="unknown KV transport 'rdma': use one of tcp, mooncake_te, store"):
            make()
    assert TRANSPORTS == ("tcp", "mooncake_te", "store")


def test_missing_pieces_are_refused_clearly(te_engine) -> None:
    with pytest.raises(ValueError, match="needs a Mooncake Transfer Engine"):
        make_sender("mooncake_te", endpoint=("127.0.0.1", 1))
    with pytest.raises(ValueError, match="cannot use TLS"):
        make_receiver("mooncake_te", te=te_engine, tls=ssl_placeholder())
    with pytest.raises(ValueError, match="needs the store decode pulls from"):
        make_receiver("store")


def ssl_placeholder():
    import ssl

    return ssl.create_default_context()


async def _round_trip(rx: ReceiveBackend, tx: TransferBackend, cache_id: str, codec: str = "none") -> None:
    specs = hybrid_specs(n=4)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, cache_id=cache_id, codec=codec)
    sink = Collector()
    rx.expect(Expectation(m.cache_id, sink, fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS)),
                          tenant="tenant-a"))
    async with tx.open(m) as out:
        for layer in sorted(kv):
            await out.send(LayerKVChunk(layer, 0, *kv[layer]))
        stats = await out.commit()
    assert await rx.wait(m.cache_id) == m
    # Answerable right after wait() returned, on every receiver.
    assert rx.transfer_bytes(m.cache_id) == (stats.raw_bytes, stats.wire_bytes)
    assert rx.transfer_bytes("nobody") == (0, 0)
    assert rx.counters()["transfers_completed"] >= 1
    assert isinstance(rx.notify(m.cache_id), bool)
    if codec == "none":
        assert_identical(m, kv, sink)
    assert sink.calls == m.frame_count


@pytest.mark.parametrize("transport", ["tcp", "tcp+tls", "store", "store+tls",
                                       pytest.param("mooncake_te", marks=pytest.mark.mooncake)])
async def test_every_transport_round_trips_through_the_factories(request, tls_files, transport: str) -> None:
    name, _, tls = transport.partition("+")
    server_tls = server_context(tls_files.server_cert, tls_files.server_key, tls_files.ca) if tls else None
    client_tls = client_context(tls_files.ca, tls_files.client_cert, tls_files.client_key) if tls else None
    te = request.getfixturevalue("te_engine") if name == "mooncake_te" else None
    store = EmbeddedStore(memory_capacity_bytes=64 << 20) if name == "store" else None
    rx = make_receiver(name, host="127.0.0.1", port=0, tls=server_tls, timeout_ms=30_000, store=store, te=te)
    assert isinstance(rx, ReceiveBackend)
    async with rx:
        host, port = parse_endpoint(rx.address)
        # Prefill has no store of its own for 'store': it reaches decode's store server at the address.
        tx = make_sender(name, endpoint=(host, port), tls=client_tls, connections=2, timeout_ms=30_000, te=te)
        assert isinstance(tx, TransferBackend)
        await _round_trip(rx, tx, f"factory-{transport}")
        await _round_trip(rx, tx, f"factory-{transport}-2", codec="int8+lz4")
        await tx.close()
        cancelled = f"cancelled-{transport}"
        rx.expect(Expectation(cancelled, Collector(), timeout_s=5))
        rx.cancel(cancelled, "test")
        with pytest.raises(TransferError):
            await rx.wait(cancelled)
    if name == "store":  # close() stopped the store server on decode's KV port
        with pytest.raises(OSError):
            socket.create_connection((host, port), timeout=1).close()
        assert store is not None
        store.close()


async def test_store_sender_to_a_missing_server_fails_with_connection() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tx = make_sender("store", endpoint=("127.0.0.1", port), timeout_ms=500, max_retry=0)
    m = build_manifest(hybrid_specs(n=2), TOKENS, cache_id="nowhere")
    with pytest.raises(TransferError) as info:
        async with tx.open(m):
            pass
    assert info.value.reason is Reason.CONNECTION
    assert f"127.0.0.1:{port}" in str(info.value)
    await tx.close()


async def test_store_receiver_with_a_cluster_store_serves_nothing() -> None:
    """A store that is not embedded (a Mooncake Store client) is already reachable: nothing is served,
    and the receiver's address describes the store."""

    class ClusterClient:  # KVStore by delegation, as MooncakeStore is one without being embedded
        address = "mooncake://master:50051"

        def __init__(self) -> None:
            self._inner = EmbeddedStore(memory_capacity_bytes=1 << 20)

        def __getattr__(self, name: str):
            return getattr(self._inner, name)

    store = ClusterClient()
    async with make_receiver("store", store=store) as rx:  # type: ignore[arg-type]
        assert rx.address == "mooncake://master:50051"
        assert rx.server is None  # type: ignore[attr-defined]
    store.close()


async def test_shared_resources_from_the_config_words(tmp_path) -> None:
    """open_shared makes what a worker holds (None, the decode's embedded store, a TE engine);
    the factories take it as shared=; close_shared releases it."""
    assert await open_shared("tcp") is None
    assert await open_shared("store", store="embedded", role="prefill") is None
    with pytest.raises(ValueError, match="use one of embedded, mooncake"):
        check_available("store", "redis")
    check_available("store", "embedded")
    decode_store = await open_shared("store", store="embedded", role="decode", segment_mb=8,
                                     disk_dir=str(tmp_path / "disk"), disk_mb=8)
    assert isinstance(decode_store, EmbeddedStore)
    async with make_receiver("store", shared=decode_store, timeout_ms=30_000) as rx:
        tx = make_sender("store", endpoint=parse_endpoint(rx.address), shared=None, timeout_ms=30_000)
        await _round_trip(rx, tx, "shared-store")
        await tx.close()
    await close_shared(decode_store)
    await close_shared(None)


@pytest.mark.mooncake
async def test_shared_te_engine(te_engine) -> None:
    check_available("mooncake_te")
    engine = await open_shared("mooncake_te")
    try:
        async with make_receiver("mooncake_te", shared=engine, timeout_ms=30_000) as rx:
            tx = make_sender("mooncake_te", endpoint=parse_endpoint(rx.address), shared=engine, timeout_ms=30_000)
            await _round_trip(rx, tx, "shared-te")
    finally:
        await close_shared(engine)
