"""Mooncake Transfer Engine backend: frames move one-sided by TE, control and verification as over TCP."""

from __future__ import annotations

import asyncio
import time

import pytest

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.wire import max_frame_body, token_digest

from .helpers import (
    FINGERPRINT,
    Collector,
    assert_identical,
    build_manifest,
    expectation,
    hybrid_specs,
    make_kv,
)

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
        rx.expect(expectation(m.cache_id, sink, fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS))))
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
        rx.expect(expectation(m.cache_id, sink, fingerprint="0" * 64))
        with pytest.raises(TransferError) as info:
            await _send(TESender(rx.endpoint, send_engine), m, kv)
        assert info.value.reason is Reason.FINGERPRINT_MISMATCH
        assert sink.calls == 0
    async with KVReceiver() as plain:
        plain.expect(expectation(m.cache_id, Collector()))
        with pytest.raises(TransferError):  # a TCP receiver gives no TE region: the sender cannot start
            await _send(TESender(plain.endpoint, send_engine, max_retry=0), m, kv)


_RECEIVER_PROCESS = """
import asyncio, hashlib, sys
import torch
from crossfill.kv.mooncake_te import MooncakeTransferEngine
from crossfill.kv.assembler import Expectation
from crossfill.kv.te_backend import TEReceiver

async def main():
    seen = {}
    def sink(chunk):
        seen[(chunk.layer, chunk.start)] = chunk
    async with TEReceiver(MooncakeTransferEngine(), region_bytes=1 << 20) as rx:
        rx.expect(Expectation(sys.argv[1], sink, fingerprint=sys.argv[2]))
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


# -- concurrency, reconnection, failure bounds ------------------------------------------------

async def _send_layers(tx, kv, layers) -> None:
    for layer in layers:
        await tx.send(LayerKVChunk(layer, 0, *kv[layer]))


def _count_writes(engine, monkeypatch) -> dict[str, int]:
    """Spy on the sender engine's submit_write: writes submitted, and most in flight at one submit."""
    seen = {"writes": 0, "most_in_flight": 0}
    live: list = []
    submit = engine.submit_write

    def spy(*args, **kwargs):
        live[:] = [p for p in live if not p.finished]
        pending = submit(*args, **kwargs)
        live.append(pending)
        seen["writes"] += 1
        seen["most_in_flight"] = max(seen["most_in_flight"], len(live))
        return pending

    monkeypatch.setattr(engine, "submit_write", spy)
    return seen


async def _many_frames(send_engine, recv_engine, cache_id: str, ring_frames: int):
    from crossfill.kv.te_backend import TEReceiver, TESender

    specs = hybrid_specs(n=8, heads=2, dim=32, window=64)
    tokens = 600
    kv = make_kv(specs, tokens, seed=3)
    m = build_manifest(specs, tokens, cache_id=cache_id, frame_tokens=8)
    sink = Collector()
    async with TEReceiver(recv_engine, region_bytes=ring_frames * max_frame_body(m)) as rx:
        rx.expect(expectation(m.cache_id, sink, fingerprint=FINGERPRINT))
        stats = await _send(TESender(rx.endpoint, send_engine), m, kv)
        assert (await rx.wait(m.cache_id)) == m
    assert stats.frames == sink.calls == m.frame_count > 25 * ring_frames
    assert_identical(m, kv, sink)
    return m


async def test_many_frames_through_a_small_ring_overlap(engines, monkeypatch) -> None:
    """About 200 frames through a ring of 6: writes overlap and the ring's space is reused throughout."""
    send_engine, recv_engine = engines
    seen = _count_writes(send_engine, monkeypatch)
    await _many_frames(send_engine, recv_engine, "many-frames", ring_frames=6)
    assert seen["most_in_flight"] > 1, "TE writes never overlapped"


async def test_frames_queued_behind_busy_writes_share_a_write(engines, monkeypatch) -> None:
    """With every write slot busy, frames that queue up next to each other in the ring go in one write."""
    import crossfill.kv.te_backend as te_backend

    send_engine, recv_engine = engines
    monkeypatch.setattr(te_backend, "MAX_WRITES", 1)  # small frames outpace one write at a time
    seen = _count_writes(send_engine, monkeypatch)
    m = await _many_frames(send_engine, recv_engine, "coalesced", ring_frames=6)
    assert seen["writes"] < m.frame_count, "frames next to each other were never written together"


def _record_manifest_answers(rx) -> list[str]:
    """Keep the text of every manifest answer a TEReceiver's frame path gives (its region)."""
    answers: list[str] = []
    accepted_text = rx.frames.accepted_text

    def recording(a):
        answers.append(accepted_text(a))
        return answers[-1]

    rx.frames.accepted_text = recording
    return answers


@pytest.mark.parametrize("direction, cut_after", [("up", 150), ("down", 120)])
async def test_cut_control_stream_reconnects_and_completes_identically(engines, direction: str,
                                                                        cut_after: int) -> None:
    """The control stream is cut mid-transfer (FRAME_REFs lost, or their answers): the sender
    reconnects, the receiver hands back the same region, every frame reaches the sink once."""
    from crossfill.kv.te_backend import TEReceiver, TESender
    from crossfill.net.linkemu import LinkEmulator

    send_engine, recv_engine = engines
    specs = hybrid_specs(n=6, heads=2, dim=32)
    kv = make_kv(specs, TOKENS, seed=1)
    m = build_manifest(specs, TOKENS, cache_id=f"cut-{direction}")
    sink = Collector()
    async with TEReceiver(recv_engine, region_bytes=8 * max_frame_body(m)) as rx:
        manifest_answers = _record_manifest_answers(rx)
        rx.expect(expectation(m.cache_id, sink, fingerprint=FINGERPRINT))
        async with LinkEmulator(upstream=("127.0.0.1", rx.port)) as emu:
            sender = TESender(f"127.0.0.1:{emu.listen_port}", send_engine, timeout_ms=30_000)
            async with sender.open(m) as tx:
                await _send_layers(tx, kv, [0])
                emu.arm(cut_after_bytes=cut_after, direction=direction)
                await _send_layers(tx, kv, range(1, 6))
                stats = await tx.commit()
            assert emu.counters.cuts >= 1
        assert (await rx.wait(m.cache_id)) == m
        regions_registered = len(rx.frames.regions)
    assert stats.reconnects >= 1
    assert len(manifest_answers) >= 2 and len(set(manifest_answers)) == 1  # one region, handed out again
    assert_identical(m, kv, sink)
    assert sink.calls == m.frame_count  # a frame accepted before the cut was not applied again
    assert regions_registered == 0  # the one region, released when the transfer retired


class _LoseFirstCommitAnswer:
    """Mixin for a control server: the first commit is verified (the transfer completes) but its
    answer is lost with the stream, as when the link breaks right after the receiver acted."""

    lost = False

    async def _on_commit(self, bound, body):
        reply = await super()._on_commit(bound, body)
        if not self.lost:
            self.lost = True
            raise ConnectionResetError("test: the commit's answer is lost")
        return reply


@pytest.mark.parametrize("retired", [False, True], ids=["region-kept", "transfer-retired"])
async def test_lost_commit_answer_reconnects_and_succeeds(engines, retired: bool) -> None:
    """The sender reconnects after the commit was verified: it commits again on the same region,
    or (the decode side already took the KV and released the region) learns it completed."""
    import asyncio

    from crossfill.kv.te_backend import TEReceiver, TESender

    class Receiver(_LoseFirstCommitAnswer, TEReceiver):
        pass

    send_engine, recv_engine = engines
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS, seed=2)
    m = build_manifest(specs, TOKENS, cache_id=f"lost-commit-{retired}")
    sink = Collector()
    async with Receiver(recv_engine) as rx:
        manifest_answers = _record_manifest_answers(rx)
        rx.expect(expectation(m.cache_id, sink, fingerprint=FINGERPRINT))
        waiter = asyncio.create_task(rx.wait(m.cache_id)) if retired else None
        async with TESender(rx.endpoint, send_engine, timeout_ms=30_000).open(m) as tx:
            await _send_layers(tx, kv, sorted(kv))
            stats = await tx.commit()
        assert (await (waiter or rx.wait(m.cache_id))) == m
        assert rx.lost
    first, *again = manifest_answers
    # retired: the region is gone and the receiver says the transfer completed; else: the same region
    assert again == (['{"complete": true}'] if retired else [first])
    assert stats.reconnects >= 1
    assert_identical(m, kv, sink)
    assert sink.calls == m.frame_count


async def test_refused_frame_is_written_again(engines) -> None:
    """A frame whose bytes arrive damaged is refused; the sender writes it again by TE and it is accepted."""
    from crossfill.kv.control import ControlServer
    from crossfill.kv.te_backend import FRAME_REF, TEFrames, TESender

    class DamagingFrames(TEFrames):
        damaged = 0

        async def frame_ref(self, server, bound, body):
            region = self.regions.get(bound.cache_id) if bound is not None else None
            if region is not None and self.damaged < 2:
                self.damaged += 1
                offset, length = FRAME_REF.unpack(body)
                region.array[offset + length - 1] ^= 0xFF  # last payload byte
            return await super().frame_ref(server, bound, body)

    send_engine, recv_engine = engines
    specs = hybrid_specs(n=3)
    kv = make_kv(specs, TOKENS, seed=4)
    m = build_manifest(specs, TOKENS, cache_id="refused")
    sink = Collector()
    async with ControlServer(frames=DamagingFrames(recv_engine)) as rx:  # the TE path, composed
        rx.expect(expectation(m.cache_id, sink, fingerprint=FINGERPRINT))
        stats = await _send(TESender(rx.endpoint, send_engine), m, kv)
        assert (await rx.wait(m.cache_id)) == m
        assert rx.counters().get("refused_checksum") == 2
    assert stats.retransmits >= 2
    assert_identical(m, kv, sink)
    assert sink.calls == m.frame_count


@pytest.mark.parametrize("how", ["closed", "silent"])
async def test_receiver_gone_for_good_fails_with_connection_in_bounded_time(engines, how: str) -> None:
    """The receiver disappears mid-transfer (its port closed, or a link that passes nothing): the
    sender gives up after max_retry reconnections with `connection`, within its deadlines."""
    import time

    from crossfill.kv.te_backend import TEReceiver, TESender
    from crossfill.net.linkemu import LinkEmulator

    send_engine, recv_engine = engines
    specs = hybrid_specs(n=4)
    kv = make_kv(specs, TOKENS, seed=5)
    m = build_manifest(specs, TOKENS, cache_id=f"gone-{how}")
    timeout_ms, max_retry = 500, 2
    rx = await TEReceiver(recv_engine).start()
    emu = LinkEmulator(upstream=("127.0.0.1", rx.port))
    await emu.start()
    try:
        rx.expect(expectation(m.cache_id, Collector(), fingerprint=FINGERPRINT))
        sender = TESender(f"127.0.0.1:{emu.listen_port}", send_engine, timeout_ms=timeout_ms, max_retry=max_retry)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            async with sender.open(m) as tx:
                await _send_layers(tx, kv, [0])
                if how == "closed":
                    await emu.stop()  # nothing listens there any more
                    await rx.close()
                else:
                    emu.arm(stall_ms=60_000)  # connections are accepted, but nothing gets through
                t0 = time.monotonic()  # from the receiver's disappearance
                await _send_layers(tx, kv, range(1, 4))
                await tx.commit()
        elapsed = time.monotonic() - t0
    finally:
        await emu.stop()
        await rx.close()
    assert info.value.reason is Reason.CONNECTION, info.value
    # silent: one timeout to notice, then max_retry handshakes of one timeout each, plus backoffs;
    # the rest is room for a loaded machine (a sender that kept retrying would never end)
    assert elapsed < (max_retry + 3) * timeout_ms / 1000 + 10.0


async def test_receiver_without_memory_for_a_region_refuses_clearly(engines, monkeypatch) -> None:
    """A TE receiver that cannot register the transfer's staging region answers `no_resources`:
    the sender fails at once with that reason (no reconnect loop) and decode's wait() learns it."""
    from crossfill.kv.mooncake_te import MooncakeTEError
    from crossfill.kv.te_backend import TEReceiver, TESender

    send_engine, recv_engine = engines
    specs = hybrid_specs(n=2, heads=2, dim=32)
    kv = make_kv(specs, TOKENS)
    m = build_manifest(specs, TOKENS, cache_id="no-memory")

    def refuse(nbytes: int):
        raise MooncakeTEError(f"cannot register {nbytes} bytes")

    monkeypatch.setattr(recv_engine, "allocate", refuse)
    async with TEReceiver(recv_engine) as rx:
        rx.expect(expectation(m.cache_id, Collector(), fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS))))
        waiting = asyncio.create_task(rx.wait(m.cache_id))
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="no_resources") as info:
            await _send(TESender(rx.endpoint, send_engine, timeout_ms=120_000), m, kv)
        assert info.value.reason is Reason.NO_RESOURCES
        assert time.monotonic() - t0 < 30  # refused at once, not left to its (2-minute) timeout
        with pytest.raises(TransferError) as waited:
            await waiting
        assert waited.value.reason is Reason.NO_RESOURCES
        assert rx.counters()["refused_no_resources"] == 1
