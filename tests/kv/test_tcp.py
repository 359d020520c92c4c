"""The built-in TCP backend end to end on loopback: integrity, TLS, refusals, deadlines, recovery."""

from __future__ import annotations

import asyncio
import gc
import itertools
import socket
import time
import weakref

import pytest
import torch

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.chunker import FrameCutter, encode_piece
from crossfill.kv.codecs import parse_codec
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.tcp import KVReceiver, KVSender, parse_endpoint
from crossfill.kv.tls import TLSConfigError, client_context, server_context
from crossfill.kv.wire import (
    MAX_MANIFEST_BYTES,
    MsgType,
    make_frame,
    manifest_body,
    max_frame_body,
    message,
    parse_answer,
    read_message,
    token_digest,
)
from crossfill.net.linkemu import LinkEmulator

from .helpers import (
    FINGERPRINT,
    Collector,
    FlipProxy,
    assert_identical,
    build_manifest,
    expectation,
    hybrid_specs,
    make_kv,
)

pytestmark = pytest.mark.timeout(60)

TOKENS = 120
# A silence bound no test waits out: a bound on elapsed time far below it shows that something
# other than a timeout (a refusal, an abort, a shorter bound the test set) ended the wait.
NEVER_MS = 120_000


async def _send_all(sender: KVSender, manifest, kv, chunk_tokens: int = TOKENS):
    async with sender.open(manifest) as tx:
        for layer in sorted(kv):
            k, v = kv[layer]
            for a in range(0, TOKENS, chunk_tokens):
                await tx.send(LayerKVChunk(layer, a, k[a:a + chunk_tokens], v[a:a + chunk_tokens]))
        return await tx.commit()


def _expect(rx: KVReceiver, manifest, sink, **kw) -> None:
    rx.expect(expectation(manifest.cache_id, sink, fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS)),
              tenant="tenant-a", **kw))


@pytest.mark.parametrize("codec,connections", [("none", 1), ("none", 4), ("zstd", 3), ("lz4", 2)])
async def test_lossless_round_trip_is_bit_identical(codec: str, connections: int) -> None:
    specs = hybrid_specs()
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, codec=codec)
    sink = Collector()
    async with KVReceiver() as rx:
        _expect(rx, m, sink)
        stats = await _send_all(KVSender(rx.endpoint, connections=connections), m, kv, chunk_tokens=50)
        assert (await rx.wait(m.cache_id)) == m
    assert_identical(m, kv, sink)
    assert sink.calls == m.frame_count == stats.frames
    assert stats.raw_bytes == m.raw_bytes() and stats.retransmits == 0
    assert rx.counters()["transfers_completed"] == 1


async def test_lossy_codec_shrinks_and_stays_within_bound() -> None:
    specs = hybrid_specs(dim=64)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, codec="int8+zstd", frame_tokens=64)
    sink = Collector()
    async with KVReceiver() as rx:
        _expect(rx, m, sink)
        stats = await _send_all(KVSender(rx.endpoint), m, kv)
        await rx.wait(m.cache_id)
    assert stats.compression_ratio >= 3.5
    for e in m.layers:
        k, _ = sink.layer(e.index)
        ref = kv[e.index][0][e.start:e.end]
        assert float((k - ref).abs().max()) <= float(ref.abs().max()) / 254 * 1.01
    assert parse_codec(m.codec).quantiser == "int8"


async def test_sender_pins_the_kv_until_the_commit_is_acknowledged() -> None:
    """The chunk's tensors stay alive (pinned by the frames) until the receiver acknowledged the commit."""
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, frame_tokens=32)
    sink = Collector()
    expected = {i: (k.clone(), v.clone()) for i, (k, v) in kv.items()}
    refs = [weakref.ref(t.untyped_storage()) for pair in kv.values() for t in pair]
    async with KVReceiver() as rx:
        _expect(rx, m, sink)
        async with KVSender(rx.endpoint, connections=2).open(m) as tx:
            for layer in list(kv):
                await tx.send(LayerKVChunk(layer, 0, *kv.pop(layer)))  # the transfer now owns the chunk
            gc.collect()
            assert all(r() is not None for r in refs)  # pinned while frames may still be resent
            await tx.commit()
        gc.collect()
        assert all(r() is None for r in refs)  # released once the commit was acknowledged
        await rx.wait(m.cache_id)
    assert_identical(m, expected, sink)


async def test_mutual_tls_round_trip_and_rogue_client_refused(tls_files) -> None:
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS)
    server = server_context(tls_files.server_cert, tls_files.server_key, tls_files.ca)
    good = client_context(tls_files.ca, tls_files.client_cert, tls_files.client_key)
    rogue = client_context(tls_files.ca, tls_files.rogue_cert, tls_files.rogue_key)
    async with KVReceiver(tls=server) as rx:
        m = build_manifest(specs, TOKENS, cache_id="tls-ok")
        sink = Collector()
        _expect(rx, m, sink)
        await _send_all(KVSender(rx.endpoint, tls=good, connections=2), m, kv)
        await rx.wait("tls-ok")
        assert_identical(m, kv, sink)

        m2 = build_manifest(specs, TOKENS, cache_id="tls-rogue")
        sink2 = Collector()
        _expect(rx, m2, sink2)
        for ctx in (rogue, None):  # a certificate from another CA, then plain TCP
            with pytest.raises(TransferError) as info:
                await _send_all(KVSender(rx.endpoint, tls=ctx, max_retry=1, timeout_ms=30_000), m2, kv)
            assert info.value.reason is Reason.CONNECTION
        assert sink2.calls == 0


def test_tls_config_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(TLSConfigError, match="does not exist"):
        client_context(tmp_path / "nope.pem")
    (tmp_path / "a.pem").write_text("x")
    with pytest.raises(TLSConfigError, match="private key file"):
        server_context(tmp_path / "a.pem", tmp_path / "b.pem")
    (tmp_path / "b.pem").write_text("not a key")
    with pytest.raises(TLSConfigError, match="cannot load TLS material"):
        server_context(tmp_path / "a.pem", tmp_path / "b.pem")


async def test_unexpected_cache_id_is_refused_counted_and_sender_stops_after_max_retry() -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, cache_id="nobody-expects-me")
    async with KVReceiver() as rx:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="unknown_cache_id") as info:
            await _send_all(KVSender(rx.endpoint, connections=2, max_retry=2, stripe_min_rtt_ms=0,
                                     timeout_ms=NEVER_MS), m, kv)
        assert info.value.reason is Reason.UNKNOWN_CACHE_ID
        assert time.monotonic() - t0 < 30  # the refusals ended it, not the sender's timeout
        # 2 streams x (1 try + 2 retries) manifests, plus the frames sent behind them, all refused
        assert rx.counters()["refused_unknown_cache_id"] >= 2 * 3
        assert "frames_accepted" not in rx.counters()


@pytest.mark.parametrize("field,reason", [("fingerprint", Reason.FINGERPRINT_MISMATCH),
                                          ("token_digest", Reason.TOKEN_DIGEST_MISMATCH),
                                          ("tenant", Reason.TENANT_MISMATCH)])
async def test_mismatched_manifest_fails_both_sides_before_any_write(field: str, reason: Reason) -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    sink = Collector()
    async with KVReceiver() as rx:
        expected = {"fingerprint": FINGERPRINT, "token_digest": token_digest(range(TOKENS)), "tenant": "tenant-a"}
        expected[field] = "something-else"
        rx.expect(expectation(m.cache_id, sink, **expected))
        with pytest.raises(TransferError) as info:
            await _send_all(KVSender(rx.endpoint), m, kv)
        assert info.value.reason is reason
        with pytest.raises(TransferError) as waited:
            await rx.wait(m.cache_id)
        assert waited.value.reason is reason
        assert rx.counters()[f"refused_{reason.label}"] >= 1
    assert sink.calls == 0


async def test_expired_cache_id_refused_before_any_write() -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, ttl_s=-5)
    sink = Collector()
    async with KVReceiver() as rx:
        _expect(rx, m, sink)
        with pytest.raises(TransferError) as info:
            await _send_all(KVSender(rx.endpoint), m, kv)
        assert info.value.reason is Reason.EXPIRED
        with pytest.raises(TransferError, match="expired"):
            await rx.wait(m.cache_id)
        assert rx.counters()["refused_expired"] >= 1
    assert sink.calls == 0


async def test_wait_for_kv_that_never_comes_raises_on_deadline() -> None:
    async with KVReceiver(timeout_ms=NEVER_MS) as rx:
        rx.expect(expectation("never", Collector(), timeout_ms=300))
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            await rx.wait("never")
        assert info.value.reason is Reason.TIMEOUT
        assert 0.25 < time.monotonic() - t0 < 30  # the expectation's 300 ms, not the receiver's default
        rx.expect(expectation("never-either", Collector(), timeout_ms=60_000, deadline=time.monotonic() + 0.2))
        with pytest.raises(TransferError, match="deadline"):
            await rx.wait("never-either")
        with pytest.raises(TransferError) as info:
            await rx.wait("not-registered")
        assert info.value.reason is Reason.UNKNOWN_CACHE_ID


async def test_sender_dying_mid_transfer_fails_the_receiver_within_its_deadline() -> None:
    specs = hybrid_specs(n=2)
    m = build_manifest(specs, TOKENS, frame_tokens=16)
    sink = Collector()
    async with KVReceiver(timeout_ms=NEVER_MS) as rx:
        _expect(rx, m, sink, timeout_ms=400)
        # A sender process that crashes: manifest and one good frame, then the socket just closes.
        entry, start, end = m.slot(0)
        payload = bytes(2 * (end - start) * entry.num_kv_heads * entry.head_dim * 4)
        frame = make_frame(0, entry.index, start, end, m.codec, len(payload), payload)
        with socket.create_connection(parse_endpoint(rx.endpoint)) as s:
            s.sendall(message(MsgType.MANIFEST, manifest_body(m)) + frame.to_bytes())
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            await rx.wait(m.cache_id)
        assert info.value.reason is Reason.TIMEOUT
        assert time.monotonic() - t0 < 30  # the expectation's 400 ms, not the receiver's default
    assert sink.calls == 1  # it got one verified frame, and is told to discard it


async def test_sender_exception_aborts_the_receiver_at_once() -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    async with KVReceiver() as rx:
        _expect(rx, m, Collector(), timeout_ms=NEVER_MS)
        with pytest.raises(RuntimeError, match="prefill crashed"):
            async with KVSender(rx.endpoint).open(m) as tx:
                await tx.send(LayerKVChunk(0, 0, *kv[0]))
                await asyncio.sleep(0.1)
                raise RuntimeError("prefill crashed")
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            await rx.wait(m.cache_id)
        assert info.value.reason is Reason.ABORTED and "prefill crashed" in str(info.value)
        assert time.monotonic() - t0 < 30  # told at once, not left to time out


async def test_flipped_payload_byte_is_refused_retransmitted_and_final_kv_identical() -> None:
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    sink = Collector()
    async with KVReceiver() as rx:
        _expect(rx, m, sink)
        flip_at = len(message(MsgType.MANIFEST, manifest_body(m))) + 200  # inside frame 0's payload
        async with FlipProxy(rx.port, flip_at) as proxy:
            stats = await _send_all(KVSender(proxy.endpoint, connections=1), m, kv)
            assert proxy.flipped
        await rx.wait(m.cache_id)
    assert rx.counters()["refused_checksum"] == 1
    assert stats.retransmits == 1
    assert_identical(m, kv, sink)
    assert sink.calls == m.frame_count  # the corrupted copy never reached the sink


@pytest.mark.parametrize("fault", [{"corrupt_bytes": 3}, {"cut_after_bytes": 20_000}])
async def test_link_faults_mid_transfer_recover_with_identical_kv(fault: dict) -> None:
    """Corruption anywhere (headers included) or a cut connection: resend, reconnect, finish intact."""
    specs = hybrid_specs(n=4, heads=4, dim=32)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    sink = Collector()
    async with KVReceiver() as rx:
        # Corruption in an envelope's length field leaves both ends waiting for bytes that never
        # come: the sender's silence bound (2 s) is what notices and reconnects, so the receiver
        # must not give up first (a spurious reconnect on a loaded machine is harmless here).
        _expect(rx, m, sink, timeout_ms=NEVER_MS)
        async with LinkEmulator(upstream=("127.0.0.1", rx.port), bandwidth="200mbit", latency="1ms") as emu:
            sender = KVSender(f"127.0.0.1:{emu.listen_port}", connections=2, timeout_ms=2000)
            async with sender.open(m) as tx:
                await tx.send(LayerKVChunk(0, 0, *kv[0]))
                await asyncio.sleep(0.05)
                emu.arm(**fault)
                for layer in range(1, 4):
                    await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
                stats = await tx.commit()
        await rx.wait(m.cache_id)
    assert_identical(m, kv, sink)
    assert stats.retransmits >= 1 or stats.reconnects >= 1
    if "cut_after_bytes" in fault:
        assert stats.reconnects >= 1


async def test_sink_failure_fails_transfer_with_sink_error() -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)

    def broken_sink(chunk: LayerKVChunk) -> None:
        raise MemoryError("no free KV blocks")

    async with KVReceiver() as rx:
        _expect(rx, m, broken_sink)
        with pytest.raises(TransferError) as info:
            await _send_all(KVSender(rx.endpoint), m, kv)
        assert info.value.reason is Reason.SINK_ERROR
        with pytest.raises(TransferError, match="no free KV blocks"):
            await rx.wait(m.cache_id)


async def test_bytes_in_flight_stay_bounded_by_a_slow_receiver() -> None:
    specs = hybrid_specs(n=4, heads=4, dim=64)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, frame_tokens=8)
    frame_bytes = 16 + 45 + 4 + 2 * 8 * 4 * 64 * 4
    limit = 3 * frame_bytes
    peak = 0

    async def slow_sink(chunk: LayerKVChunk) -> None:
        await asyncio.sleep(0.002)

    async with KVReceiver() as rx:
        _expect(rx, m, slow_sink)
        async with KVSender(rx.endpoint, connections=4, max_inflight_bytes=limit).open(m) as tx:
            for layer, (k, v) in kv.items():
                await tx.send(LayerKVChunk(layer, 0, k, v))
            commit = asyncio.create_task(tx.commit())
            while not commit.done():
                peak = max(peak, tx.inflight)  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            await commit
        await rx.wait(m.cache_id)
    assert 0 < peak <= limit + frame_bytes


async def test_receiver_cancel_refuses_later_frames() -> None:
    specs = hybrid_specs(n=2)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS)
    sink = Collector()
    async with KVReceiver() as rx:
        _expect(rx, m, sink)
        rx.cancel(m.cache_id, "request aborted by user")
        with pytest.raises(TransferError) as info:
            await _send_all(KVSender(rx.endpoint), m, kv)
        assert info.value.reason is Reason.ABORTED
    assert sink.calls == 0


def test_endpoint_and_option_errors() -> None:
    with pytest.raises(ValueError, match="host:port"):
        KVSender("localhost")
    with pytest.raises(ValueError, match="connections"):
        KVSender("127.0.0.1:9", connections=0)
    with pytest.raises(ValueError, match="port"):
        KVSender("127.0.0.1:70000")
    assert parse_endpoint("[::1]:80") == ("::1", 80)


async def test_large_frame_right_behind_the_manifest_is_accepted() -> None:
    """The read limit is raised by the manifest; a 2 MiB frame arriving in the same read must wait for it."""
    specs = [LayerSpec(0, "full", None, 4, 64, torch.float32)]
    kv = make_kv(specs, 1024)
    m = build_manifest(specs, 1024, frame_tokens=1024)
    assert max_frame_body(m) > MAX_MANIFEST_BYTES
    sink = Collector()
    async with KVReceiver() as rx:
        rx.expect(expectation(m.cache_id, sink))
        frame = encode_piece(m, FrameCutter(m).cut(LayerKVChunk(0, 0, *kv[0]))[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", rx.port)
        writer.write(message(MsgType.MANIFEST, manifest_body(m)) + frame.to_bytes())
        await writer.drain()
        answers = [parse_answer(*(await read_message(reader, 1 << 20))) for _ in range(2)]
        writer.close()
    assert [a.reason for a in answers] == [Reason.OK, Reason.OK]
    assert sink.calls == 1


async def test_short_link_uses_one_stream_and_a_long_one_stripes() -> None:
    """Loopback: one stream (more only compete for cores); a 10 ms round trip: every stream,
    opened at once for later transfers to the same endpoint."""
    specs = hybrid_specs(n=4, heads=4, dim=32)
    kv = make_kv(specs, TOKENS)
    async with KVReceiver() as rx:
        near = KVSender(rx.endpoint, connections=4)
        deadline = time.monotonic() + 30
        for i in itertools.count():
            # A loaded machine only delays answers (the measured round trip can only grow), so the
            # first transfers may stripe; the least round trip seen soon shows the link is short.
            # The deadline is only a safety net: transfers go on until one round trip was short.
            m = build_manifest(specs, TOKENS, cache_id=f"near-{i}")
            sink = Collector()
            _expect(rx, m, sink)
            await _send_all(near, m, kv, chunk_tokens=30)
            await rx.wait(m.cache_id)
            assert_identical(m, kv, sink)
            if (near.rtt_s is not None and near.rtt_s < near.stripe_min_rtt_s) or time.monotonic() > deadline:
                break
        assert near.rtt_s is not None and near.rtt_s < near.stripe_min_rtt_s
        m = build_manifest(specs, TOKENS, cache_id="near-last")
        _expect(rx, m, Collector())
        assert (await _send_all(near, m, kv, chunk_tokens=30)).streams == 1
        await rx.wait(m.cache_id)

        forced = build_manifest(specs, TOKENS, cache_id="forced")
        _expect(rx, forced, Collector())
        assert (await _send_all(KVSender(rx.endpoint, connections=4, stripe_min_rtt_ms=0), forced, kv,
                                chunk_tokens=30)).streams == 4
        await rx.wait(forced.cache_id)

        async with LinkEmulator(upstream=("127.0.0.1", rx.port), bandwidth="1gbit", latency="5ms") as emu:
            far = KVSender(f"127.0.0.1:{emu.listen_port}", connections=4)
            for i in range(2):
                m = build_manifest(specs, TOKENS, cache_id=f"far-{i}")
                sink = Collector()
                _expect(rx, m, sink)
                async with far.open(m) as tx:
                    # The first transfer learns the round trip; the second opens every stream at once.
                    assert sum(c.started for c in tx.conns) == (1 if i == 0 else 4)  # type: ignore[attr-defined]
                    for layer in sorted(kv):
                        await tx.send(LayerKVChunk(layer, 0, *kv[layer]))
                    stats = await tx.commit()
                await rx.wait(m.cache_id)
                assert_identical(m, kv, sink)
                assert stats.streams == 4
            assert far.rtt_s is not None and far.rtt_s >= 0.010


def test_stripe_threshold_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="stripe_min_rtt_ms"):
        KVSender("127.0.0.1:9", stripe_min_rtt_ms=-1)
