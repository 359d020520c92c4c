"""Cutting prefill chunks into frame slots: any chunking gives the same frames; bad chunks are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.chunker import ChunkError, FrameCutter

from .helpers import build_manifest, hybrid_specs, make_kv


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 99), max_size=6, unique=True))
def test_any_chunking_yields_the_same_frames(cuts: list[int]) -> None:
    specs = hybrid_specs(n=3)
    m = build_manifest(specs, tokens=100, frame_tokens=16)
    kv = make_kv(specs, 100)
    bounds = [0, *sorted(cuts), 100]
    cutter = FrameCutter(m)
    pieces = {}
    for s in specs:
        for a, b in zip(bounds, bounds[1:], strict=False):
            for p in cutter.cut(LayerKVChunk(s.index, a, kv[s.index][0][a:b], kv[s.index][1][a:b])):
                pieces[p.seq] = p
    assert cutter.incomplete() == []
    assert sorted(pieces) == list(range(m.frame_count))
    for p in pieces.values():
        assert torch.equal(p.k, kv[p.layer][0][p.start:p.end]) and torch.equal(p.v, kv[p.layer][1][p.start:p.end])


def test_bad_chunks_are_refused_with_the_reason() -> None:
    specs = hybrid_specs(n=3)
    m = build_manifest(specs, tokens=40)
    kv = make_kv(specs, 40)
    cutter = FrameCutter(m)
    k, v = kv[2]
    with pytest.raises(ChunkError, match="layer 7"):
        cutter.cut(LayerKVChunk(7, 0, k, v))
    with pytest.raises(ChunkError, match="expected 0"):
        cutter.cut(LayerKVChunk(2, 5, k[5:], v[5:]))
    with pytest.raises(ChunkError, match="dtype"):
        cutter.cut(LayerKVChunk(2, 0, k.half(), v.half()))
    with pytest.raises(ChunkError, match="beyond"):
        cutter.cut(LayerKVChunk(2, 0, torch.cat([k, k]), torch.cat([v, v])))
    cutter.cut(LayerKVChunk(2, 0, k[:10], v[:10]))
    assert any("layer 2 has tokens up to 10" in s for s in cutter.incomplete())
