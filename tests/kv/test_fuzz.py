"""Fuzzing the receiver: mutated, truncated, oversized and random input never crashes it and is never accepted."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.chunker import FrameCutter, encode_piece
from crossfill.kv.codecs import decode_kv
from crossfill.kv.errors import CodecError, WireError
from crossfill.kv.tcp import KVReceiver
from crossfill.kv.wire import (
    ENVELOPE,
    MsgType,
    check_frame,
    commit_body,
    commit_digest,
    manifest_body,
    message,
    parse_frame,
    token_digest,
)

from .helpers import FINGERPRINT, Collector, build_manifest, expectation, hybrid_specs, make_kv

TOKENS = 40
SPECS = hybrid_specs(n=3, heads=2, dim=8, window=16)
KV = make_kv(SPECS, TOKENS, seed=7)


def _valid_stream(codec: str) -> tuple[object, list, bytes]:
    # Built at import time: a long TTL so a slow full-suite run does not expire them before use.
    m = build_manifest(SPECS, TOKENS, codec=codec, frame_tokens=16, cache_id=f"fuzz-{codec}", ttl_s=3600.0)
    cutter = FrameCutter(m)
    frames = []
    for s in SPECS:
        for piece in cutter.cut(LayerKVChunk(s.index, 0, *KV[s.index])):
            frames.append(encode_piece(m, piece))
    frames.sort(key=lambda f: f.seq)
    stream = message(MsgType.MANIFEST, manifest_body(m)) + b"".join(f.to_bytes() for f in frames)
    stream += message(MsgType.COMMIT, commit_body(m.frame_count, commit_digest([f.checksum for f in frames])))
    return m, frames, stream


STREAMS = {codec: _valid_stream(codec) for codec in ("none", "zstd", "int8+lz4")}


def _reseal(buf: bytearray, at: int) -> None:
    """Recompute the envelope check at `at`, so a forged length passes it and hits the size limits."""
    head = bytes(buf[at:at + ENVELOPE.size - 4])
    buf[at + ENVELOPE.size - 4:at + ENVELOPE.size] = struct.pack("!I", xxhash.xxh32_intdigest(head))


def _envelope_offsets(stream: bytes) -> list[int]:
    out, at = [], 0
    while at < len(stream):
        out.append(at)
        at += ENVELOPE.size + ENVELOPE.unpack_from(stream, at)[4]
    return out


async def _feed(codec: str, data: bytes) -> tuple[str, Collector, list]:
    m, _, _ = STREAMS[codec]
    errors: list = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    sink = Collector()
    async with KVReceiver() as rx:
        rx.expect(expectation(m.cache_id, sink, fingerprint=FINGERPRINT, token_digest=token_digest(range(TOKENS)),
                  tenant="tenant-a", timeout_ms=60_000))
        reader, writer = await asyncio.open_connection("127.0.0.1", rx.port)
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 30)  # the receiver answers everything, then hangs up (at EOF)
        writer.close()
        status = rx.status(m.cache_id)
    return status, sink, errors


def _check_outcome(codec: str, status: str, sink: Collector, errors: list) -> None:
    m, _, _ = STREAMS[codec]
    assert errors == [], f"receiver raised unexpectedly: {errors}"
    lossless = codec in ("none", "zstd")
    for (layer, start), chunk in sink.chunks.items():  # nothing corrupted ever reached the sink
        ref = KV[layer][0][start:chunk.end]
        if lossless:
            assert torch.equal(chunk.k, ref) and torch.equal(chunk.v, KV[layer][1][start:chunk.end])
        else:
            assert float((chunk.k - ref).abs().max()) <= float(ref.abs().max()) / 254 * 1.01
    if status == "complete":
        assert len(sink.chunks) == m.frame_count


@pytest.mark.timeout(120)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec=st.sampled_from(sorted(STREAMS)), data=st.data())
def test_mutated_truncated_or_oversized_stream(codec: str, data: st.DataObject) -> None:
    _, _, stream = STREAMS[codec]
    buf = bytearray(stream)
    kind = data.draw(st.sampled_from(["flip", "truncate", "oversize", "garbage"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
        assume(bytes(buf) != stream)
    elif kind == "truncate":
        del buf[data.draw(st.integers(0, len(buf) - 1)):]
    elif kind == "oversize":
        at = data.draw(st.sampled_from(_envelope_offsets(stream)))
        struct.pack_into("!I", buf, at + 8, data.draw(st.sampled_from([2**31, 2**32 - 1, 300_000_000, 5_000_000])))
        if data.draw(st.booleans()):
            _reseal(buf, at)
    else:
        buf = bytearray(data.draw(st.binary(min_size=1, max_size=400)))
    status, sink, errors = asyncio.run(_feed(codec, bytes(buf)))
    _check_outcome(codec, status, sink, errors)
    assert status != "complete"  # every byte is covered by a check, and nothing is resent here


def test_clean_stream_completes() -> None:
    """The fuzz harness itself: the unmutated stream is accepted, so refusals above are real."""
    for codec in STREAMS:
        status, sink, errors = asyncio.run(_feed(codec, STREAMS[codec][2]))
        assert status == "complete" and not errors
        _check_outcome(codec, status, sink, errors)


@settings(max_examples=150, deadline=None)
@given(codec=st.sampled_from(sorted(STREAMS)), index=st.integers(0, 10_000), flips=st.lists(
    st.tuples(st.integers(0, 100_000), st.integers(1, 255)), min_size=1, max_size=3))
def test_mutated_frame_is_never_accepted(codec: str, index: int, flips: list[tuple[int, int]]) -> None:
    m, frames, _ = STREAMS[codec]
    frame = frames[index % len(frames)]
    body = bytearray(frame.to_bytes()[ENVELOPE.size:])
    for pos, x in flips:
        body[pos % len(body)] ^= x
    assume(bytes(body) != frame.to_bytes()[ENVELOPE.size:])  # flips that cancel out are no mutation
    try:
        f = parse_frame(bytes(body))
        entry = check_frame(m, f)
        decode_kv(m.codec, f.payload, f.end - f.start, entry.num_kv_heads, entry.head_dim, entry.torch_dtype)
    except (WireError, CodecError):
        return
    pytest.fail("a mutated frame passed every check")
