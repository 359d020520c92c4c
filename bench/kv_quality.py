"""KV codec quality on real models: bytes shipped vs quality of what decode then computes.

    .venv/bin/python bench/kv_quality.py [--models smollm2-135m,gemma3-270m] [--limit 50] [--tokens 64]
                                         [--codecs none,bf16,fp8,fp8+zstd,int8,int8+zstd]

For each prompt of bench/data/kv_quality_prompts.json (50 prompts, short / medium / long):

1. prefill the prompt with the Hugging Face reference model (the same weights crossfill serves,
   from its model cache) and keep the KV cache; for Gemma 3 the sliding layers already hold only
   their window, as a crossfill `hybrid_attention` transfer would ship;
2. generate `--tokens` greedy tokens from the uncompressed cache (the baseline);
3. for each codec, encode + decode every layer's K and V in frames exactly as the transfer layer
   does (`crossfill.kv.codecs`, frames of `auto_frame_tokens`), then run the baseline tokens through
   the model on top of the round-tripped cache (teacher forcing) and compare with the uncompressed
   cache: greedy agreement = share of positions whose argmax equals the baseline token; KL =
   mean KL(baseline || codec) of the next-token distributions over those positions.

Bytes are reported against the full fp32 cache (every token of every layer: what a transfer
without window pruning would carry) and against bf16 of the same, so the pruning gain and the
codec gain show together. Target (issue 3): an fp8 or int8 codec >= 3.5x vs fp32 with >= 97%
agreement.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from crossfill.kv.codecs import decode_kv, encode_kv, parse_codec

PROMPTS = Path(__file__).parent / "data" / "kv_quality_prompts.json"
TARGET_FRAME_BYTES = 1 << 20


def model_dir(name: str) -> Path:
    """The dequantised model crossfill serves (`crossfill models pull <name>` puts it there)."""
    from crossfill.models.cache import is_cached
    from crossfill.models.cache import model_dir as cached_dir

    if not is_cached(name):
        raise SystemExit(f"model {name!r} is not in the model cache: run `crossfill models pull {name}` first")
    return cached_dir(name)


def frame_tokens(heads: int, dim: int) -> int:
    per_token = 2 * heads * dim * 4
    t = max(16, min(4096, TARGET_FRAME_BYTES // per_token))
    return 1 << (t.bit_length() - 1)


def round_trip(cache, spec: str) -> tuple[object, int]:
    """A copy of `cache` whose every layer went through the codec; returns it and the encoded bytes."""
    out = copy.deepcopy(cache)
    wire = 0
    for layer in out.layers:
        k, v = layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous()  # [T, H, D]
        t, h, d = k.shape
        step = frame_tokens(h, d)
        ks, vs = [], []
        for a in range(0, t, step):
            payload = encode_kv(spec, k[a:a + step], v[a:a + step])
            wire += len(payload)
            dk, dv = decode_kv(spec, payload, min(step, t - a), h, d, k.dtype)
            ks.append(dk)
            vs.append(dv)
        layer.keys = torch.cat(ks).transpose(0, 1).unsqueeze(0).contiguous()
        layer.values = torch.cat(vs).transpose(0, 1).unsqueeze(0).contiguous()
    return out, wire


@torch.no_grad()
def evaluate(name: str, prompts: list[dict], codecs: list[str], tokens: int) -> dict[str, dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    stats: dict[str, dict[str, list[float]]] = {c: {"agree": [], "kl": [], "wire": [], "full": []} for c in codecs}
    for i, p in enumerate(prompts):
        ids = tok(p["prompt"], return_tensors="pt").input_ids
        n = ids.shape[1]
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        # Baseline: greedy generation from the uncompressed cache.
        gen, nxt, base_cache = [], int(out.logits[0, -1].argmax()), copy.deepcopy(cache)
        for _ in range(tokens):
            gen.append(nxt)
            step = model(torch.tensor([[nxt]]), past_key_values=base_cache, use_cache=True)
            base_cache = step.past_key_values
            nxt = int(step.logits[0, -1].argmax())
        forced = torch.tensor([gen])
        ref = model(forced, past_key_values=copy.deepcopy(cache), use_cache=True).logits[0].float()
        ref_logp = F.log_softmax(ref, dim=-1)
        full_fp32 = 2 * layers * n * kv_heads * head_dim * 4
        for spec in codecs:
            rt, wire = round_trip(cache, spec)
            logits = model(forced, past_key_values=rt, use_cache=True).logits[0].float()
            # Position j predicts token j+1: compare with the baseline's own next tokens.
            agree = (logits[:-1].argmax(-1) == forced[0, 1:]).float().mean().item()
            logp = F.log_softmax(logits, dim=-1)
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
            s = stats[spec]
            s["agree"].append(agree)
            s["kl"].append(kl)
            s["wire"].append(wire)
            s["full"].append(full_fp32)
        print(f"  {name} prompt {i + 1}/{len(prompts)} ({p['kind']}, {n} tokens) done", flush=True)
    return {spec: {"agree": statistics.mean(s["agree"]), "kl": statistics.mean(s["kl"]),
                   "vs_fp32": sum(s["full"]) / sum(s["wire"]), "vs_bf16": sum(s["full"]) / 2 / sum(s["wire"])}
            for spec, s in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description="KV codec quality on real models")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--codecs", default="none,bf16,fp8,fp8+zstd,int8,int8+zstd")
    ap.add_argument("--limit", type=int, default=50, help="use the first N prompts of each kind, round-robin")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' cache-argument renames
    data = json.loads(PROMPTS.read_text())["prompts"]
    by_kind: dict[str, list[dict]] = {}
    for p in data:
        by_kind.setdefault(p["kind"], []).append(p)
    order = [p for group in zip(*by_kind.values(), strict=False) for p in group]
    order += [p for p in data if p not in order]
    prompts = order[:args.limit]
    codecs = [str(parse_codec(c)) for c in args.codecs.split(",")]
    t0 = time.time()
    results = {m: evaluate(m, prompts, codecs, args.tokens) for m in args.models.split(",")}
    print(f"\n{len(prompts)} prompts ({', '.join(sorted({p['kind'] for p in prompts}))}), {args.tokens} greedy tokens, "
          f"{time.time() - t0:.0f} s")
    for m, rows in results.items():
        print(f"\n{m}")
        print(f"  {'codec':<11} {'vs fp32':>8} {'vs bf16':>8} {'agreement':>10} {'mean KL':>9}")
        for spec, r in rows.items():
            print(f"  {spec:<11} {r['vs_fp32']:>7.2f}x {r['vs_bf16']:>7.2f}x {r['agree'] * 100:>9.1f}% {r['kl']:>9.5f}")


if __name__ == "__main__":
    main()
