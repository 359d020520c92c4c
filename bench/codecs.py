"""Each KV codec's size ratio (vs fp32 and vs bf16) and encode/decode speed, side by side.

    .venv/bin/python bench/codecs.py [--tokens 256] [--heads 8] [--dim 64] [--runs 5]

Speeds are MB/s of raw fp32 KV processed (median of --runs). The KV is Gaussian-like with a few
outlier key channels, as real keys have; lossless ratios on such random data are a lower bound
(real KV compresses somewhat better, especially after quantisation).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from crossfill.kv.codecs import decode_kv, encode_kv, parse_codec, raw_size

CODECS = ["none", "zstd", "lz4", "bf16", "bf16+zstd", "fp16", "fp8", "fp8-channel", "fp8-token",
          "fp8+zstd", "fp8+lz4", "int8", "int8+zstd", "int8+lz4"]


def synthetic_kv(tokens: int, heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, dim, generator=g)
    k[:, :, :: max(1, dim // 4)] *= 8.0  # outlier channels
    v = torch.randn(tokens, heads, dim, generator=g)
    return k, v


def measure(spec: str, k: torch.Tensor, v: torch.Tensor, runs: int) -> dict[str, float]:
    t, h, d = k.shape
    raw = raw_size(t, h, d, torch.float32)
    enc, dec = [], []
    payload = encode_kv(spec, k, v)
    decode_kv(spec, payload, t, h, d, torch.float32)  # warm up
    for _ in range(runs):
        t0 = time.perf_counter()
        payload = encode_kv(spec, k, v)
        t1 = time.perf_counter()
        dk, dv = decode_kv(spec, payload, t, h, d, torch.float32)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    err = max(float((dk - k).abs().max() / k.abs().max()), float((dv - v).abs().max() / v.abs().max()))
    return {
        "vs_fp32": raw / len(payload),
        "vs_bf16": raw / 2 / len(payload),
        "enc_mbs": raw / statistics.median(enc) / 1e6,
        "dec_mbs": raw / statistics.median(dec) / 1e6,
        "max_rel_err": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per frame (the default frame size)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--codecs", default=",".join(CODECS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    k, v = synthetic_kv(args.tokens, args.heads, args.dim)
    mb = raw_size(args.tokens, args.heads, args.dim, torch.float32) / 1e6
    print(f"frame: {args.tokens} tokens x {args.heads} heads x {args.dim} dim, fp32 K+V = {mb:.2f} MB, "
          f"median of {args.runs}, 1 thread")
    print(f"{'codec':<12} {'vs fp32':>8} {'vs bf16':>8} {'enc MB/s':>9} {'dec MB/s':>9} {'max err/absmax':>15}")
    for spec in args.codecs.split(","):
        r = measure(str(parse_codec(spec)), k, v, args.runs)
        print(f"{spec:<12} {r['vs_fp32']:>7.2f}x {r['vs_bf16']:>7.2f}x {r['enc_mbs']:>9.0f} {r['dec_mbs']:>9.0f} "
              f"{r['max_rel_err']:>15.5f}")


if __name__ == "__main__":
    main()
