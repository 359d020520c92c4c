"""Wire format v1: manifest building/validation, frame slots, frame checks, commit digest."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfill.engine.types import LayerSpec
from crossfill.kv.errors import Reason, WireError
from crossfill.kv.wire import Manifest, check_frame, make_frame, parse_frame, token_digest

from .helpers import build_manifest, hybrid_specs


def test_manifest_prunes_sliding_layers_to_their_window() -> None:
    specs = hybrid_specs(window=32)
    m = build_manifest(specs, tokens=100, frame_tokens=16)
    for e, s in zip(m.layers, specs, strict=True):
        assert e.end == 100
        assert e.start == (100 - 31 if s.kind == "sliding" else 0)  # window-1 tokens kept
    unpruned = build_manifest(specs, tokens=100, prune=False)
    assert all(e.start == 0 for e in unpruned.layers)
    assert m.raw_bytes() < unpruned.raw_bytes()


def test_manifest_json_round_trip_and_frame_slots() -> None:
    m = build_manifest(hybrid_specs(), tokens=70, frame_tokens=16)
    again = Manifest.from_json(m.to_json())
    assert again == m
    seen = set()
    for seq in range(m.frame_count):
        entry, start, end = m.slot(seq)
        assert m.seq_of(entry.index, start) == seq
        assert entry.start <= start < end <= entry.end
        seen.update((entry.index, t) for t in range(start, end))
    assert seen == {(e.index, t) for e in m.layers for t in range(e.start, e.end)}


def _mutated(m: Manifest, **changes: object) -> bytes:
    d = json.loads(m.to_json())
    for key, value in changes.items():
        if key.startswith("layer0_"):
            d["layers"][0][key[7:]] = value
        else:
            d[key] = value
    return json.dumps(d).encode()


@pytest.mark.parametrize("changes,reason,word", [
    ({"version": 2}, Reason.UNKNOWN_VERSION, "version 2"),
    ({"frame_count": 1}, Reason.MALFORMED, "frame_count"),
    ({"layer0_end": 10**9}, Reason.TOKEN_RANGE, "token range"),
    ({"layer0_num_kv_heads": 10**6}, Reason.OVERSIZED, "shapes"),
    ({"layer0_dtype": "float64"}, Reason.MALFORMED, "dtype"),
    ({"layer0_kind": "mystery"}, Reason.MALFORMED, "kind"),
    ({"codec": "gzip"}, Reason.CODEC, "gzip"),
    ({"cache_id": ""}, Reason.MALFORMED, "cache_id"),
    ({"extra_field": 1}, Reason.MALFORMED, "extra_field"),
])
def test_manifest_refusals_name_the_problem(changes: dict, reason: Reason, word: str) -> None:
    m = build_manifest(hybrid_specs(), tokens=50)
    with pytest.raises(WireError, match=word) as info:
        Manifest.from_json(_mutated(m, **changes))
    assert info.value.reason is reason


def test_manifest_refuses_non_json_and_huge() -> None:
    with pytest.raises(WireError) as info:
        Manifest.from_json(b"\xff\x00not json")
    assert info.value.reason is Reason.MALFORMED
    with pytest.raises(WireError) as info:
        Manifest.from_json(b" " * (2 << 20))
    assert info.value.reason is Reason.OVERSIZED


def test_token_digest_depends_on_every_token() -> None:
    assert token_digest([1, 2, 3]) != token_digest([1, 2, 4])
    assert token_digest([1, 2, 3]) != token_digest([1, 2])
    assert token_digest([]) == token_digest([])


def _frame(m: Manifest, seq: int, payload: bytes | None = None):
    entry, start, end = m.slot(seq)
    raw = 2 * (end - start) * entry.num_kv_heads * entry.head_dim * 4
    return make_frame(seq, entry.index, start, end, m.codec, raw, payload if payload is not None else bytes(raw))


def test_check_frame_accepts_exact_slots_and_refuses_the_rest() -> None:
    m = build_manifest(hybrid_specs(), tokens=50, frame_tokens=16)
    good = _frame(m, 3)
    assert check_frame(m, parse_frame(good.to_bytes()[16:])).index == good.layer
    entry, start, end = m.slot(3)
    cases = [
        (make_frame(3, 99, start, end, m.codec, good.raw_len, good.payload), Reason.UNKNOWN_LAYER),
        (make_frame(3, entry.index, start + 1, end, m.codec, good.raw_len, good.payload), Reason.TOKEN_RANGE),
        (make_frame(4, entry.index, start, end, m.codec, good.raw_len, good.payload), Reason.TOKEN_RANGE),
        (make_frame(3, entry.index, start, end, "zstd", good.raw_len, good.payload), Reason.CODEC),
        (make_frame(3, entry.index, start, end, m.codec, good.raw_len * 2, good.payload), Reason.OVERSIZED),
        (make_frame(3, entry.index, start, end, m.codec, good.raw_len, bytes(good.raw_len * 2)), Reason.OVERSIZED),
    ]
    for frame, reason in cases:
        with pytest.raises(WireError) as info:
            check_frame(m, frame)
        assert info.value.reason is reason
    flipped = bytearray(good.to_bytes())
    flipped[-5] ^= 0x40
    with pytest.raises(WireError) as info:
        check_frame(m, parse_frame(bytes(flipped[16:])))
    assert info.value.reason is Reason.CHECKSUM


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 300), frame_tokens=st.integers(1, 64), n_layers=st.integers(1, 5),
       window=st.integers(1, 80), skip=st.integers(0, 300))
def test_slots_partition_every_shipped_token(tokens: int, frame_tokens: int, n_layers: int, window: int,
                                             skip: int) -> None:
    specs = [LayerSpec(i, "sliding" if i % 2 else "full", window if i % 2 else None, 1, 2, torch.float16)
             for i in range(n_layers)]
    m = Manifest.build(cache_id="c", request_id="r", tenant="t", fingerprint="x", token_ids=list(range(tokens)),
                       layer_specs=specs, prune_windows=True, skip_tokens=skip, frame_tokens=frame_tokens)
    covered = []
    for seq in range(m.frame_count):
        entry, start, end = m.slot(seq)
        covered += [(entry.index, t) for t in range(start, end)]
    assert sorted(covered) == sorted((e.index, t) for e in m.layers for t in range(e.start, e.end))
    assert len(covered) == len(set(covered))


def test_expiry_is_unix_time() -> None:
    m = build_manifest(hybrid_specs(), tokens=10, ttl_s=-1)
    assert m.is_expired()
    assert not build_manifest(hybrid_specs(), tokens=10).is_expired(time.time())


def test_default_frames_hold_about_one_mib() -> None:
    smollm2 = [LayerSpec(i, "full", None, 3, 64, torch.float32) for i in range(2)]  # 1536 B/token
    m = Manifest.build(cache_id="c", request_id="r", tenant="t", fingerprint="x", token_ids=range(4096),
                       layer_specs=smollm2)
    assert m.frame_tokens == 512
    assert 0.5 * (1 << 20) <= m.frame_tokens * smollm2[0].bytes_per_token <= (1 << 20)
    tiny = [LayerSpec(0, "full", None, 1, 1, torch.float16)]
    assert Manifest.build(cache_id="c", request_id="r", tenant="t", fingerprint="x", token_ids=range(10),
                          layer_specs=tiny).frame_tokens == 4096
