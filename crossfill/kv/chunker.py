"""Cut the LayerKVChunks prefill produces into the manifest's fixed frame slots, then encode them.

Prefill may hand over a layer at once or in pieces (chunked prefill); frames must still fall on
the manifest's slots (every `frame_tokens` from the layer's first shipped token) so the receiver
can verify their position.  Tokens before the layer's shipped range (the part of a sliding window
decode will never look at, or a prefix decode already holds) are dropped here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.codecs import encode_kv_parts, parse_codec, raw_size
from crossfill.kv.errors import KVError
from crossfill.kv.wire import Frame, LayerEntry, Manifest, make_frame


class ChunkError(KVError, ValueError):
    """A chunk that does not fit the manifest (unknown layer, gap, wrong shape or dtype)."""


@dataclass
class FramePiece:
    """K and V of one frame slot, not yet encoded."""

    seq: int
    layer: int
    start: int
    end: int
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class _LayerBuffer:
    entry: LayerEntry
    next_token: int  # first token not yet received for this layer
    frame_start: int  # first token of the frame being assembled
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)


class FrameCutter:
    """Turns chunks into frame-slot pieces; remembers partial frames across chunks."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._layers = {e.index: _LayerBuffer(e, e.start, e.start) for e in manifest.layers}

    def cut(self, chunk: LayerKVChunk) -> list[FramePiece]:
        buf = self._layers.get(chunk.layer)
        if buf is None:
            raise ChunkError(f"chunk for layer {chunk.layer}, which the manifest does not list")
        e = buf.entry
        expected_shape = (chunk.num_tokens, e.num_kv_heads, e.head_dim)
        if tuple(chunk.k.shape) != expected_shape or tuple(chunk.v.shape) != expected_shape:
            raise ChunkError(f"layer {chunk.layer}: K/V shapes {tuple(chunk.k.shape)}/{tuple(chunk.v.shape)}, "
                             f"manifest needs {expected_shape}")
        if chunk.k.dtype != e.torch_dtype or chunk.v.dtype != e.torch_dtype:
            raise ChunkError(f"layer {chunk.layer}: dtype {chunk.k.dtype}, manifest says {e.dtype}")
        lo, hi = max(chunk.start, e.start), min(chunk.end, e.end)
        if chunk.end > e.end:
            raise ChunkError(f"layer {chunk.layer}: chunk ends at token {chunk.end}, beyond the manifest's {e.end}")
        if hi <= lo:
            return []  # entirely before the shipped range (pruned window / skipped prefix)
        if lo != buf.next_token:
            raise ChunkError(f"layer {chunk.layer}: chunk starts at token {lo}, expected {buf.next_token} "
                             f"(chunks of a layer must arrive in order without gaps)")
        buf.k.append(chunk.k[lo - chunk.start:hi - chunk.start])
        buf.v.append(chunk.v[lo - chunk.start:hi - chunk.start])
        buf.next_token = hi
        out = []
        while True:
            frame_end = min(buf.frame_start + self.manifest.frame_tokens, e.end)
            if buf.next_token < frame_end:
                break
            k = torch.cat(buf.k) if len(buf.k) > 1 else buf.k[0]
            v = torch.cat(buf.v) if len(buf.v) > 1 else buf.v[0]
            n = frame_end - buf.frame_start
            out.append(FramePiece(self.manifest.seq_of(e.index, buf.frame_start), e.index, buf.frame_start,
                                  frame_end, k[:n], v[:n]))
            buf.k, buf.v = ([k[n:]], [v[n:]]) if k.shape[0] > n else ([], [])
            buf.frame_start = frame_end
            if frame_end == e.end:
                break
        # Keep private copies of a partial frame: once send() returns, prefill may reuse the memory.
        buf.k = [t.clone() for t in buf.k]
        buf.v = [t.clone() for t in buf.v]
        return out

    def incomplete(self) -> list[str]:
        """Layers whose KV has not fully arrived, as readable strings (empty when all is cut)."""
        return [f"layer {b.entry.index} has tokens up to {b.next_token} of [{b.entry.start}, {b.entry.end})"
                for b in self._layers.values() if b.next_token < b.entry.end]


def encode_piece(manifest: Manifest, piece: FramePiece) -> Frame:
    """Encode one frame-slot piece with the manifest's codec and checksum it.

    The frame may view the piece's tensors (codec none/bf16 of bf16 KV...): they are pinned by
    the frame until it is no longer needed.
    """
    e = manifest.layer(piece.layer)
    assert e is not None
    payload = encode_kv_parts(parse_codec(manifest.codec), piece.k, piece.v)
    raw = raw_size(piece.end - piece.start, e.num_kv_heads, e.head_dim, e.torch_dtype)
    return make_frame(piece.seq, piece.layer, piece.start, piece.end, manifest.codec, raw, payload)
