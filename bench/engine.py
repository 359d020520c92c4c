"""Engine vs transformers on the same weights and thread count, side by side in one run.

Prints prefill tokens/s at 512 and 2048 tokens, single-stream decode ms/token, aggregate decode
tokens/s at 1, 4 and 16 concurrent requests, KV bytes per token, and cold vs cached start times,
each as a ratio against transformers (medians of --repeats runs).

    .venv/bin/python bench/engine.py --model smollm2-135m --threads 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from crossfill import models
from crossfill.engine.engine import EngineConfig, LLMEngine
from crossfill.engine.sampling import SamplingParams


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_prefill(engine: LLMEngine, ids: list[int]) -> None:
    engine.add_request("p", ids, SamplingParams(temperature=0, max_tokens=1), prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    for g in engine.cache.groups:  # measure compute, not prefix-cache hits
        g.pool.clear_cache()


def engine_decode(engine: LLMEngine, prompts: list[list[int]], new: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"d{i}", ids, params)
    while engine.has_unfinished():
        engine.step()
    for g in engine.cache.groups:
        g.pool.clear_cache()


def hf_generate(hf, ids: list[int], new: int) -> None:
    x = torch.tensor([ids])
    hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights, activations and KV dtype for both crossfill and transformers")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    results: dict[str, float | str] = {"model": args.model, "threads": args.threads, "dtype": args.dtype}

    # Start times: cold = dequantise from a fresh cache; cached = load the cached safetensors.
    files = models.resolve_model(args.model)
    t0 = time.perf_counter()
    engine = LLMEngine.from_model(args.model, EngineConfig(kv_memory_mb=768, max_num_batched_tokens=2048, dtype=dtype))
    results["start_cached_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype).eval()
    results["hf_load_s"] = time.perf_counter() - t0

    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    for n in map(int, args.lengths.split(",")):
        ids = torch.randint(10, vocab, (n,), generator=gen).tolist()
        ours = median_time(lambda ids=ids: engine_prefill(engine, ids), args.repeats)
        with torch.inference_mode():
            theirs = median_time(lambda ids=ids: hf(torch.tensor([ids]), logits_to_keep=1), args.repeats)
        results[f"prefill_{n}_tok_s"] = n / ours
        results[f"hf_prefill_{n}_tok_s"] = n / theirs
        results[f"prefill_{n}_ratio"] = theirs / ours

    prompt = torch.randint(10, vocab, (64,), generator=gen).tolist()
    new = args.decode_tokens
    with torch.inference_mode():
        t_hf = median_time(lambda: hf_generate(hf, prompt, new), args.repeats)
        t_hf_prefill = median_time(lambda: hf_generate(hf, prompt, 1), args.repeats)
    hf_ms = (t_hf - t_hf_prefill) / (new - 1) * 1000
    t_ours = median_time(lambda: engine_decode(engine, [prompt], new), args.repeats)
    t_ours_prefill = median_time(lambda: engine_decode(engine, [prompt], 1), args.repeats)
    ours_ms = (t_ours - t_ours_prefill) / (new - 1) * 1000
    results["decode_ms_per_token"] = ours_ms
    results["hf_decode_ms_per_token"] = hf_ms
    results["decode_speedup"] = hf_ms / ours_ms
    hf_single_tok_s = 1000 / hf_ms
    for c in map(int, args.concurrency.split(",")):
        prompts = [torch.randint(10, vocab, (64,), generator=gen).tolist() for _ in range(c)]
        t = median_time(lambda prompts=prompts: engine_decode(engine, prompts, new), args.repeats)
        results[f"aggregate_decode_{c}_tok_s"] = c * new / t
        results[f"aggregate_decode_{c}_vs_hf_single"] = (c * new / t) / hf_single_tok_s

    per_token = sum(s.bytes_per_token for s in engine.layer_specs)
    results["kv_bytes_per_token_all_layers"] = per_token
    results["kv_bytes_at_4096_tokens"] = sum(s.kept_tokens(4096) * s.bytes_per_token for s in engine.layer_specs)

    # Cold start: dequantise into a throwaway cache (registry models only).
    if args.model in {m.name for m in models.known_models()}:
        tmp = Path(tempfile.mkdtemp())
        try:
            import os

            env_before = os.environ.get("CROSSFILL_HOME")
            os.environ["CROSSFILL_HOME"] = str(tmp)
            t0 = time.perf_counter()
            models.resolve_model(args.model)
            results["start_cold_s"] = time.perf_counter() - t0
        finally:
            if env_before is None:
                os.environ.pop("CROSSFILL_HOME", None)
            else:
                os.environ["CROSSFILL_HOME"] = env_before
            shutil.rmtree(tmp, ignore_errors=True)

    if args.json:
        print(json.dumps(results, indent=2))
        return
    for key, value in results.items():
        print(f"{key:40s} {value:.3f}" if isinstance(value, float) else f"{key:40s} {value}")


if __name__ == "__main__":
    main()
