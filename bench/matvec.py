"""The memory-bandwidth floor of single-stream decode on this machine.

One decode step multiplies one activation row by every weight matrix, so it reads every weight
once. This times that matrix-vector product over SmolLM2-sized MLP weights in fp32 and bf16 and
prints the implied bandwidth and the ms/token floor for a model of a given size.

    .venv/bin/python bench/matvec.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--matrices", type=int, default=60, help="weight matrices of 1536x576 (SmolLM2's MLP)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--model-mb", type=float, default=540.0, help="fp32 weight bytes of the model (SmolLM2: 540)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(1536, 576) for _ in range(args.matrices)]
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        ws = [w.to(dtype) for w in weights]
        x = torch.randn(1, 576, dtype=dtype)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for w in ws:
                F.linear(x, w)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        gbps = nbytes / seconds / 1e9
        model_bytes = args.model_mb * 1e6 * (dtype.itemsize / 4)
        results[dtype] = seconds
        print(f"{str(dtype):15s} {seconds * 1000:7.2f} ms for {nbytes / 1e6:.0f} MB  = {gbps:5.1f} GB/s  "
              f"-> decode floor {model_bytes / (gbps * 1e9) * 1000:5.1f} ms/token for a {args.model_mb:.0f} MB fp32 model")
    print(f"bf16 vs fp32 matvec speed-up: {results[torch.float32] / results[torch.bfloat16]:.2f}x")


if __name__ == "__main__":
    main()
