"""Codecs: spec parsing, exact lossless round trips, lossy error within the documented bounds, sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crossfill.kv.codecs import (
    decode_kv,
    encode_kv,
    max_encoded_size,
    parse_codec,
    quantised_size,
    raw_size,
    resolve_compression,
)
from crossfill.kv.errors import CodecError

LOSSLESS = ["none", "zstd", "lz4"]
LOSSY = ["bf16", "fp16", "fp8", "fp8-channel", "fp8-token", "int8", "fp8+zstd", "int8+lz4", "bf16+zstd"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_parse_canonical_names_and_errors() -> None:
    assert str(parse_codec("FP8 + zstd")) == "fp8+zstd"
    assert str(parse_codec("none")) == "none"
    assert str(parse_codec("none+lz4")) == "lz4"
    for bad, word in [("gzip", "unknown stage 'gzip'"), ("zstd+fp8", "must come first"),
                      ("zstd+lz4", "only one lossless"), ("", "empty codec spec")]:
        with pytest.raises(CodecError, match=word):
            parse_codec(bad)


def test_compression_mode_maps_config() -> None:
    assert resolve_compression(True, "hybrid_attention", "fp8+zstd") == (parse_codec("fp8+zstd"), True)
    assert resolve_compression(False, "hybrid_attention", "fp8") == (parse_codec("none"), False)
    assert resolve_compression(True, "codec", "int8") == (parse_codec("int8"), False)
    with pytest.raises(CodecError, match="compression_mode 'magic'"):
        resolve_compression(True, "magic", "fp8")


def _bound(spec: str, k: torch.Tensor, dk: torch.Tensor, dtype: torch.dtype) -> None:
    """Documented per-codec error bound (plus the original dtype's own rounding)."""
    x = k.float()
    err = (x - dk.float()).abs()
    amax = float(x.abs().max())
    own = x.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11 if dtype == torch.float16 else 0.0)
    q = parse_codec(spec).quantiser
    if q == "bf16":
        allowed = x.abs() * 2.0 ** -8
    elif q == "fp16":
        allowed = x.abs() * 2.0 ** -11 + 2.0 ** -24
    elif q.startswith("fp8"):
        allowed = torch.full_like(x, amax / 16)
    else:
        allowed = torch.full_like(x, amax / 254)
    assert bool((err <= allowed * 1.001 + own * 2 + 1e-6).all()), f"{spec}: max err {float(err.max())}"


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), heads=st.integers(1, 4), dim=st.sampled_from([1, 4, 16, 64]),
       dtype=st.sampled_from(DTYPES), spec=st.sampled_from(LOSSLESS + LOSSY), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_round_trip_random_shapes(tokens: int, heads: int, dim: int, dtype: torch.dtype, spec: str, seed: int,
                                  scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(tokens, heads, dim, generator=g) * scale).to(dtype)
    v = (torch.randn(tokens, heads, dim, generator=g) * scale).to(dtype)
    payload = encode_kv(spec, k, v)
    assert len(payload) <= max_encoded_size(parse_codec(spec), tokens, heads, dim, dtype)
    dk, dv = decode_kv(spec, payload, tokens, heads, dim, dtype)
    assert dk.dtype == dtype and dk.shape == k.shape and dk.is_contiguous()
    if spec in LOSSLESS:
        assert torch.equal(dk, k) and torch.equal(dv, v)
    else:
        _bound(spec, k, dk, dtype)
        _bound(spec, v, dv, dtype)


def test_kivi_granularity_keeps_outlier_channel_precise() -> None:
    """Keys with one huge channel: per-channel key scales keep the other channels accurate."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(64, 2, 32, generator=g)
    k[:, :, 3] *= 100.0
    dk_chan, _ = decode_kv("int8", encode_kv("int8", k, k), 64, 2, 32, torch.float32)
    dk_tok, _ = decode_kv("fp8-token", encode_kv("fp8-token", k, k), 64, 2, 32, torch.float32)
    normal = [c for c in range(32) if c != 3]
    assert float((dk_chan - k)[:, :, normal].abs().max()) < 0.05
    assert float((dk_tok - k)[:, :, normal].abs().max()) > float((dk_chan - k)[:, :, normal].abs().max())


@pytest.mark.parametrize("spec", ["fp8", "int8", "fp8-channel", "fp8-token"])
def test_quantised_codecs_reach_3_5x_vs_fp32(spec: str) -> None:
    k = torch.randn(256, 4, 64)
    payload = encode_kv(spec, k, k)
    assert raw_size(256, 4, 64, torch.float32) / len(payload) >= 3.5


def test_lossy_refuses_what_it_cannot_represent() -> None:
    big = torch.full((2, 1, 4), 1e6)
    with pytest.raises(CodecError, match="fp16 range"):
        encode_kv("fp16", big, big)
    nan = torch.tensor([[[float("nan")]]])
    with pytest.raises(CodecError, match="inf or NaN"):
        encode_kv("fp8", nan, nan)


@pytest.mark.parametrize("spec", ["none", "zstd", "lz4", "fp8", "int8+zstd"])
def test_decode_refuses_wrong_sizes(spec: str) -> None:
    k = torch.randn(8, 2, 4)
    payload = encode_kv(spec, k, k)
    if parse_codec(spec).compressor is None:
        assert len(payload) == quantised_size(parse_codec(spec), 8, 2, 4, torch.float32)
    with pytest.raises(CodecError):
        decode_kv(spec, payload, 9, 2, 4, torch.float32)  # manifest claims more tokens than were encoded
    with pytest.raises(CodecError):
        decode_kv(spec, payload[:-1], 8, 2, 4, torch.float32)
