"""KV codecs: an optional lossy quantiser followed by an optional lossless compressor.

A codec is named by a spec string, stages joined by `+`, quantiser first:

    none | zstd | lz4 | bf16 | fp16 | fp8 | fp8-channel | fp8-token | int8 | e.g. "fp8+zstd", "int8+lz4"

Quantisers (lossy) work on one (K, V) pair of shape [tokens, kv_heads, head_dim]:

* `bf16`, `fp16`: cast.  Error: |x - x'| <= |x| * 2^-8 (bf16), <= |x| * 2^-11 (fp16, which refuses
  values beyond +-65504 instead of turning them into inf).
* `fp8` (float8 e4m3) with float32 scales; KIVI's observation is that keys have outlier *channels*
  and values do not, so `fp8` and `int8` scale keys per channel (one scale per head x dim over the
  frame's tokens) and values per token (one scale per token x head).  `fp8-channel` / `fp8-token`
  use one granularity for both.  Error: |x - x'| <= absmax(group) / 16.
* `int8`: symmetric, same granularity as `fp8`.  Error: |x - x'| <= absmax(group) / 254.

Lossless stages: `zstd` (level 1: KV is high-entropy, higher levels cost CPU for little) and `lz4`
(block format with the decoded size known from the manifest, so a forged payload cannot make the
receiver allocate more than the frame's declared size).

The encoded layout needs no inner header: the manifest gives dtype and shapes, so every length is
known in advance and checked exactly on decode.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

import lz4.block
import numpy as np
import torch
import zstandard

from crossfill.kv.errors import CodecError

QUANTISERS = ("bf16", "fp16", "fp8", "fp8-channel", "fp8-token", "int8")
COMPRESSORS = ("zstd", "lz4")
ZSTD_LEVEL = 1
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_INT8_MAX = 127.0
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec; `str(spec)` is its canonical name (what the manifest carries)."""

    quantiser: str | None = None
    compressor: str | None = None

    def __str__(self) -> str:
        parts = [p for p in (self.quantiser, self.compressor) if p]
        return "+".join(parts) if parts else "none"

    @property
    def lossless(self) -> bool:
        return self.quantiser is None

    def key_granularity(self) -> str:
        return "token" if self.quantiser == "fp8-token" else "channel"

    def value_granularity(self) -> str:
        return "channel" if self.quantiser == "fp8-channel" else "token"


@lru_cache(maxsize=64)
def parse_codec(spec: str) -> CodecSpec:
    """Parse a codec spec string such as "fp8+zstd"; raises CodecError naming the bad part."""
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(f"empty codec spec {spec!r}; use e.g. 'none', 'zstd', 'fp8+zstd' or 'int8+lz4'")
    quantiser: str | None = None
    compressor: str | None = None
    for raw in spec.lower().split("+"):
        part = raw.strip()
        if part == "none":
            continue
        if part in QUANTISERS:
            if quantiser is not None or compressor is not None:
                raise CodecError(
                    f"codec spec {spec!r}: quantiser {part!r} must come first and only once "
                    f"(e.g. 'fp8+zstd')"
                )
            quantiser = part
        elif part in COMPRESSORS:
            if compressor is not None:
                raise CodecError(f"codec spec {spec!r}: only one lossless stage is allowed")
            compressor = part
        else:
            raise CodecError(
                f"codec spec {spec!r}: unknown stage {part!r}; known: none, "
                f"{', '.join(QUANTISERS + COMPRESSORS)}"
            )
    return CodecSpec(quantiser, compressor)


def resolve_compression(enabled: bool, mode: str, codec: str) -> tuple[CodecSpec, bool]:
    """Map the seed's `kv_cache.compression_enabled/compression_mode` plus a codec to (codec, prune).

    `hybrid_attention` means: ship only the window sliding layers still need, then apply `codec`.
    `codec` alone applies the codec without pruning; `none` (or enabled=False) sends raw KV.
    """
    if not enabled or mode == "none":
        return parse_codec("none"), False
    if mode == "hybrid_attention":
        return parse_codec(codec), True
    if mode == "codec":
        return parse_codec(codec), False
    raise CodecError(
        f"kv_cache.compression_mode {mode!r} is not known; use 'hybrid_attention', 'codec' or 'none'"
    )


# --- sizes -----------------------------------------------------------------------------------

def _elsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def raw_size(tokens: int, heads: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes of K plus V in their original dtype."""
    return 2 * tokens * heads * dim * _elsize(dtype)


def _tensor_quant_size(spec: CodecSpec, granularity: str, tokens: int, heads: int, dim: int,
                       dtype: torch.dtype) -> int:
    n = tokens * heads * dim
    q = spec.quantiser
    if q is None:
        return n * _elsize(dtype)
    if q in ("bf16", "fp16"):
        return n * 2
    scales = heads * dim if granularity == "channel" else tokens * heads
    return 4 * scales + n


def quantised_size(spec: CodecSpec, tokens: int, heads: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes after the quantiser and before the lossless stage (exact)."""
    return _tensor_quant_size(spec, spec.key_granularity(), tokens, heads, dim, dtype) + _tensor_quant_size(
        spec, spec.value_granularity(), tokens, heads, dim, dtype
    )


def max_encoded_size(spec: CodecSpec, tokens: int, heads: int, dim: int, dtype: torch.dtype) -> int:
    """Upper bound of an encoded payload, used to refuse oversized frames before reading them."""
    n = quantised_size(spec, tokens, heads, dim, dtype)
    if spec.compressor in ("zstd", "lz4"):
        return n + n // 128 + 1024  # both libraries' worst-case expansion is below this
    return n


# --- lossless stage --------------------------------------------------------------------------

_local = threading.local()


def _zstd_c() -> zstandard.ZstdCompressor:
    c = getattr(_local, "zc", None)
    if c is None:
        c = _local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _zstd_d() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def _compress(compressor: str | None, data: bytes) -> bytes:
    if compressor == "zstd":
        return _zstd_c().compress(data)
    if compressor == "lz4":
        return lz4.block.compress(data, store_size=False)
    return data


def _decompress(compressor: str | None, data: bytes | memoryview, size: int) -> bytes | memoryview:
    try:
        if compressor == "zstd":
            out = _zstd_d().decompress(bytes(data), max_output_size=size)
        elif compressor == "lz4":
            out = lz4.block.decompress(bytes(data), uncompressed_size=size)
        else:
            out = data
    except (zstandard.ZstdError, lz4.block.LZ4BlockError, ValueError) as exc:
        raise CodecError(f"{compressor} payload does not decompress: {exc}") from exc
    if len(out) != size:
        raise CodecError(f"payload decodes to {len(out)} bytes, the manifest's shapes need {size}")
    return out


# --- quantiser stage -------------------------------------------------------------------------

def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def _scaled(x: torch.Tensor, granularity: str, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (x / scale, scale) with scale chosen so the group's absmax maps to qmax."""
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise CodecError("KV holds inf or NaN; a scaled quantiser cannot encode it (use a lossless codec)")
    if granularity == "channel":
        amax = xf.abs().amax(dim=0, keepdim=True)  # [1, H, D]
    else:
        amax = xf.abs().amax(dim=2, keepdim=True)  # [T, H, 1]
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return xf / scale, scale


def _quantise(spec: CodecSpec, x: torch.Tensor, granularity: str) -> list[memoryview]:
    q = spec.quantiser
    if q is None:
        return [_as_bytes(x)]
    if q == "bf16":
        return [_as_bytes(x.to(torch.bfloat16))]
    if q == "fp16":
        if x.numel() and float(x.float().abs().max()) > _FP16_MAX:
            raise CodecError("KV values exceed the fp16 range (+-65504); use 'bf16' or an fp8/int8 codec")
        return [_as_bytes(x.to(torch.float16))]
    if q.startswith("fp8"):
        scaled, scale = _scaled(x, granularity, _FP8_MAX)
        data = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    else:  # int8
        scaled, scale = _scaled(x, granularity, _INT8_MAX)
        data = scaled.round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return [_as_bytes(scale.to(torch.float32)), _as_bytes(data)]


def _take(buf: bytes | bytearray | memoryview, offset: int, count: int, dtype: torch.dtype,
          shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over buf[offset:]: in place when the buffer is writable (the receiver owns it),
    else a copy (torch tensors must not alias immutable bytes)."""
    n = count * _elsize(dtype)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if not memoryview(buf).readonly:
        return torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset).view(dtype).reshape(shape)
    arr = np.frombuffer(buf, dtype=np.uint8, count=n, offset=offset).copy()
    return torch.from_numpy(arr).view(dtype).reshape(shape)


def _dequantise(spec: CodecSpec, buf: bytes | memoryview, offset: int, granularity: str, shape: tuple[int, int, int],
                dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    t, h, d = shape
    n = t * h * d
    q = spec.quantiser
    if q is None:
        return _take(buf, offset, n, dtype, shape), offset + n * _elsize(dtype)
    if q in ("bf16", "fp16"):
        wire = torch.bfloat16 if q == "bf16" else torch.float16
        return _take(buf, offset, n, wire, shape).to(dtype), offset + 2 * n
    scale_shape = (1, h, d) if granularity == "channel" else (t, h, 1)
    ns = scale_shape[0] * scale_shape[1] * scale_shape[2]
    scale = _take(buf, offset, ns, torch.float32, scale_shape)
    offset += 4 * ns
    if not bool(torch.isfinite(scale).all()):
        raise CodecError("payload carries a non-finite quantisation scale")
    qdtype = torch.float8_e4m3fn if q.startswith("fp8") else torch.int8
    data = _take(buf, offset, n, qdtype, shape)
    return (data.float() * scale).to(dtype), offset + n


# --- public API ------------------------------------------------------------------------------

def encode_kv_parts(spec: CodecSpec | str, k: torch.Tensor, v: torch.Tensor) -> list[bytes | memoryview]:
    """Encode one (K, V) pair of shape [tokens, kv_heads, head_dim] into payload parts.

    Without a lossless stage the parts are views of the (quantised) tensors, not copies: the
    caller must keep K and V unchanged until the parts are sent.
    """
    spec = parse_codec(spec) if isinstance(spec, str) else spec
    if k.shape != v.shape or k.dim() != 3:
        raise CodecError(f"K and V must share a [tokens, heads, dim] shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise CodecError(f"K and V must share a dtype, got {k.dtype} and {v.dtype}")
    parts = _quantise(spec, k.detach().cpu(), spec.key_granularity())
    parts += _quantise(spec, v.detach().cpu(), spec.value_granularity())
    if spec.compressor is None:
        return list(parts)
    return [_compress(spec.compressor, b"".join(parts))]


def encode_kv(spec: CodecSpec | str, k: torch.Tensor, v: torch.Tensor) -> bytes:
    """Encode one (K, V) pair of shape [tokens, kv_heads, head_dim] into one payload (a copy)."""
    return b"".join(encode_kv_parts(spec, k, v))


def decode_kv(spec: CodecSpec | str, payload: bytes | memoryview, tokens: int, heads: int, dim: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a payload back into owned, contiguous (K, V) tensors of the original dtype.

    Raises CodecError when the payload does not have exactly the size the shapes call for.
    """
    spec = parse_codec(spec) if isinstance(spec, str) else spec
    size = quantised_size(spec, tokens, heads, dim, dtype)
    buf = _decompress(spec.compressor, payload, size)
    shape = (tokens, heads, dim)
    k, off = _dequantise(spec, buf, 0, spec.key_granularity(), shape, dtype)
    v, off = _dequantise(spec, buf, off, spec.value_granularity(), shape, dtype)
    assert off == size  # guaranteed by quantised_size; a mismatch is a bug here, not bad input
    return k, v
