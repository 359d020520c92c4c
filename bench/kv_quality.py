"""KV codec quality on real models, through crossfill's own disaggregated path.

    .venv/bin/python bench/kv_quality.py [--models smollm2-135m,gemma3-270m] [--limit 50] [--tokens 64]
                                         [--codecs none,bf16,fp8,fp8+zstd,int8,int8+zstd] [--json FILE]

For each prompt of bench/data/kv_quality_prompts.json (50 prompts: short / medium / long), per model:

1. **prefill-only** in a crossfill engine: the KV leaves through the engine's `kv_sink` exactly as a
   prefill worker ships it (for Gemma 3 the sliding layers export only their window, as a
   `hybrid_attention` transfer does);
2. for each codec, the chunks cross a real loopback **transfer** (`KVSender` -> `KVReceiver`, frames,
   checksums, codec encode and decode), and the verified chunks are **imported** into a decode-only
   request of a crossfill engine (`import_request` / `write_kv` / `commit_import`);
3. the baseline: decode `--tokens` greedy tokens from the uncompressed import (codec `none`);
4. each codec: the baseline tokens run through the model on top of the imported cache in one
   forward pass (teacher forcing, crossfill's paged attention on the imported blocks); greedy
   agreement = share of positions whose argmax equals the baseline's next token; KL = mean
   KL(none || codec) of the next-token distributions over all positions.

The `none` row checks the harness itself: its agreement must be 100% and its KL ~0.  Bytes are the
transfer's encoded payload bytes against the full fp32 cache (every token of every layer: what a
transfer without window pruning would carry) and against bf16 of the same, so the pruning gain and
the codec gain show together.  Target (issue 3): an fp8 or int8 codec >= 3.5x vs fp32 with >= 97%
agreement.  `--models` takes model names from the crossfill model cache or model directories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from crossfill.engine.attention import ScheduledChunk, StepAttention
from crossfill.engine.engine import EngineConfig, LLMEngine
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Expectation
from crossfill.kv.codecs import parse_codec
from crossfill.kv.tcp import KVReceiver, KVSender
from crossfill.kv.wire import Manifest, token_digest

PROMPTS = Path(__file__).parent / "data" / "kv_quality_prompts.json"
WAVE = 8  # prompts decoded together for the baseline (the engine batches their decode steps)


def load_engine(name: str) -> LLMEngine:
    """fp32, no prefix cache: every prompt is prefilled from scratch and no import is ever reused."""
    cfg = EngineConfig(kv_memory_mb=1024, max_num_seqs=WAVE, max_num_batched_tokens=2048,
                       enable_prefix_caching=False)
    return LLMEngine.from_model(name, cfg)


def prefill(engine: LLMEngine, ids: list[int]) -> tuple[list[LayerKVChunk], int]:
    """Prefill-only: the KV chunks the engine exports, and the first token it samples (greedy)."""
    chunks: list[LayerKVChunk] = []
    engine.add_request("prefill", ids, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True,
                       kv_sink=chunks.append)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.prefill is not None:
                first = out.prefill.first_token_id
    assert first is not None, "prefill-only request ended without a first token"
    return chunks, first


async def transfer(engine: LLMEngine, ids: list[int], chunks: list[LayerKVChunk], codec: str,
                   cache_id: str) -> tuple[list[LayerKVChunk], int]:
    """Ship `chunks` through a real loopback transfer with `codec`; the verified chunks and wire bytes."""
    received: list[LayerKVChunk] = []
    manifest = Manifest.build(cache_id=cache_id, request_id=cache_id, tenant="bench", fingerprint=engine.fingerprint,
                              token_ids=ids, layer_specs=engine.layer_specs, codec=codec, prune_windows=True)
    async with KVReceiver() as rx:
        rx.expect(Expectation(cache_id, received.append, fingerprint=engine.fingerprint,
                              token_digest=token_digest(ids), tenant="bench", timeout_s=60.0))
        waiting = asyncio.create_task(rx.wait(cache_id))
        async with KVSender(("127.0.0.1", rx.port), connections=1, timeout_ms=60_000).open(manifest) as tx:
            for chunk in chunks:
                await tx.send(chunk)
            stats = await tx.commit()
        await waiting
    return received, stats.wire_bytes


def import_kv(engine: LLMEngine, rid: str, ids: list[int], chunks: list[LayerKVChunk], first: int,
              max_tokens: int) -> None:
    engine.import_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for chunk in chunks:
        engine.write_kv(rid, chunk)
    engine.commit_import(rid, first)


def score(engine: LLMEngine, rid: str, forced: list[int]) -> torch.Tensor:
    """Logits of every position of `forced` run on top of the request's imported KV (teacher forcing).

    One prefill-like chunk of the engine's own model and paged attention at positions
    [prompt_len, prompt_len + len(forced)); the request is released afterwards.
    """
    seq = engine.requests[rid]
    n = seq.num_computed
    seq.tokens[n:] = forced
    chunk = ScheduledChunk(seq, n, len(forced))
    if engine.kv.append_slots(seq, n + len(forced)) is None:
        raise RuntimeError(f"no free KV blocks to score {len(forced)} tokens: raise kv_memory_mb")
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(forced), torch.arange(n, n + len(forced)),
                              StepAttention(engine.cache, [], [chunk]))
        logits = engine.model.compute_logits(hidden).float()
    engine.abort(rid, "scored")
    engine.take_pending()
    return logits


def generate_baseline(engine: LLMEngine, work: list[dict], tokens: int) -> None:
    """Greedy decode from the uncompressed imports, WAVE prompts at a time; fills w['gen']."""
    for at in range(0, len(work), WAVE):
        wave = work[at:at + WAVE]
        for w in wave:
            import_kv(engine, w["rid"], w["ids"], w["none_chunks"], w["first"], tokens)
            w["gen"] = []
        by_id = {w["rid"]: w for w in wave}
        while engine.has_unfinished():
            outs = engine.take_pending() + engine.step()
            for out in outs:
                by_id[out.request_id]["gen"].extend(out.new_token_ids)
        for w in wave:
            assert len(w["gen"]) == tokens, f"baseline produced {len(w['gen'])} tokens, expected {tokens}"


def evaluate(name: str, prompts: list[dict], codecs: list[str], tokens: int) -> dict[str, dict[str, float]]:
    engine = load_engine(name)
    spec0 = engine.layer_specs[0]
    stats = {c: {"agree": [], "kl": [], "wire": [], "full": []} for c in codecs}
    work = []
    for i, p in enumerate(prompts):
        # Keep room for the generated tokens; only a model with a short context ever cuts a prompt.
        ids = engine.encode(p["prompt"])[: engine.max_model_len - tokens - 1]
        chunks, first = prefill(engine, ids)
        work.append({"rid": f"q{i}", "ids": ids, "chunks": chunks, "first": first, "kind": p["kind"]})
    for w in work:  # the uncompressed transfer is the baseline every codec is compared with
        w["none_chunks"], w["none_wire"] = asyncio.run(transfer(engine, w["ids"], w["chunks"], "none", w["rid"] + "-n"))
    generate_baseline(engine, work, tokens)
    for i, w in enumerate(work):
        forced = w["gen"]  # position j predicts forced[j + 1]
        full_fp32 = 2 * len(engine.layer_specs) * len(w["ids"]) * spec0.num_kv_heads * spec0.head_dim * 4
        ref_logp = None
        for codec in ["none"] + [c for c in codecs if c != "none"]:
            if codec == "none":
                got, wire = w["none_chunks"], w["none_wire"]
            else:
                got, wire = asyncio.run(transfer(engine, w["ids"], w["chunks"], codec, f"{w['rid']}-{codec}"))
            import_kv(engine, w["rid"], w["ids"], got, w["first"], tokens)
            logp = F.log_softmax(score(engine, w["rid"], forced), dim=-1)
            if ref_logp is None:
                ref_logp = logp
            if codec not in stats:
                continue
            s = stats[codec]
            s["agree"].append((logp[:-1].argmax(-1) == torch.tensor(forced[1:])).float().mean().item())
            s["kl"].append((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item())
            s["wire"].append(wire)
            s["full"].append(full_fp32)
        print(f"  {name} prompt {i + 1}/{len(work)} ({w['kind']}, {len(w['ids'])} tokens) done", flush=True)
    return {c: {"agree": statistics.mean(s["agree"]), "kl": statistics.mean(s["kl"]),
                "vs_fp32": sum(s["full"]) / sum(s["wire"]), "vs_bf16": sum(s["full"]) / 2 / sum(s["wire"])}
            for c, s in stats.items()}


def pick_prompts(limit: int) -> list[dict]:
    """The first `limit` prompts taking the kinds round-robin, so a short run still mixes lengths."""
    data = json.loads(PROMPTS.read_text())["prompts"]
    by_kind: dict[str, list[dict]] = {}
    for p in data:
        by_kind.setdefault(p["kind"], []).append(p)
    order = [p for group in zip(*by_kind.values(), strict=False) for p in group]
    order += [p for p in data if p not in order]
    return order[:limit]


def main() -> None:
    ap = argparse.ArgumentParser(description="KV codec quality on real models, through crossfill's transfer + import")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--codecs", default="none,bf16,fp8,fp8+zstd,int8,int8+zstd")
    ap.add_argument("--limit", type=int, default=50, help="use the first N prompts, taking the kinds round-robin")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = pick_prompts(args.limit)
    codecs = [str(parse_codec(c)) for c in args.codecs.split(",")]
    t0 = time.time()
    results = {m: evaluate(m, prompts, codecs, args.tokens) for m in args.models.split(",")}
    kinds = ", ".join(f"{sum(p['kind'] == k for p in prompts)} {k}" for k in sorted({p["kind"] for p in prompts}))
    print(f"\n{len(prompts)} prompts ({kinds}), {args.tokens} greedy tokens, {time.time() - t0:.0f} s")
    for m, rows in results.items():
        print(f"\n{m}")
        print(f"  {'codec':<11} {'vs fp32':>8} {'vs bf16':>8} {'agreement':>10} {'mean KL':>9}")
        for codec, r in rows.items():
            print(f"  {codec:<11} {r['vs_fp32']:>7.2f}x {r['vs_bf16']:>7.2f}x {r['agree'] * 100:>9.1f}% {r['kl']:>9.5f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
