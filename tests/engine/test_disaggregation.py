"""Prefill-only on one engine, KV imported into another, decode: identical to one colocated run."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from crossfill.engine.async_engine import AsyncEngine
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import LayerKVChunk, NoKVCapacityError

from .helpers import make_engine, run_all, tokens_of


def disaggregated(prefill_engine, decode_engine, rid, prompt, params):
    """Returns (generated tokens, exported chunks)."""
    chunks: list[LayerKVChunk] = []
    prefill_engine.add_request(rid, prompt, params, prefill_only=True, kv_sink=chunks.append)
    result = run_all(prefill_engine)[rid][-1].prefill
    assert result is not None
    decode_engine.import_request(rid, prompt, params)
    for chunk in chunks:
        decode_engine.write_kv(rid, chunk)
    decode_engine.commit_import(rid, result.first_token_id)
    return tokens_of(run_all(decode_engine)[rid]), chunks


@pytest.mark.parametrize("seed", [0, 1])
def test_remote_prefill_equals_colocated(tiny_dir, seed):
    rng = random.Random(seed)
    a, b, colo = make_engine(tiny_dir), make_engine(tiny_dir), make_engine(tiny_dir)
    for i in range(3):
        prompt = [rng.randrange(3, a.vocab_size) for _ in range(rng.randrange(1, 90))]
        for params in (
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.95, seed=seed + i, max_tokens=16, ignore_eos=True),
        ):
            got, _ = disaggregated(a, b, f"r{i}", prompt, params)
            colo.add_request(f"r{i}", prompt, params)
            assert got == tokens_of(run_all(colo)[f"r{i}"])
    assert b.kv_stats().blocks_used == 0 and a.kv_stats().blocks_used == 0


def test_sliding_layers_export_at_most_the_window(tiny_gemma3_dir):
    a, b = make_engine(tiny_gemma3_dir), make_engine(tiny_gemma3_dir)
    prompt = list(range(3, 103))  # 100 tokens, window 24
    _, chunks = disaggregated(a, b, "w", prompt, SamplingParams(temperature=0, max_tokens=4))
    for spec in a.layer_specs:
        exported = sum(c.num_tokens for c in chunks if c.layer == spec.index)
        nbytes = sum(c.k.numel() * c.k.element_size() * 2 for c in chunks if c.layer == spec.index)
        if spec.kind == "sliding":
            assert exported == spec.window - 1
            assert nbytes <= spec.window * spec.bytes_per_token
        else:
            assert exported == len(prompt)


def test_prefix_hit_on_the_prefill_side_still_exports_the_whole_kv(tiny_dir):
    a, b, colo = make_engine(tiny_dir), make_engine(tiny_dir), make_engine(tiny_dir)
    prompt = list(range(3, 70))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    disaggregated(a, b, "first", prompt, params)
    got, chunks = disaggregated(a, b, "second", prompt, params)
    colo.add_request("c", prompt, params)
    assert got == tokens_of(run_all(colo)["c"])


def test_import_refuses_misplaced_kv_and_missing_layers(tiny_llama_dir):
    a, b = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=4)
    chunks: list[LayerKVChunk] = []
    a.add_request("r", prompt, params, prefill_only=True, kv_sink=chunks.append)
    first = run_all(a)["r"][-1].prefill.first_token_id
    b.import_request("r", prompt, params)
    bad = chunks[0]
    with pytest.raises(ValueError, match="layer 99"):
        b.write_kv("r", LayerKVChunk(99, 0, bad.k, bad.v))
    with pytest.raises(ValueError, match="shape"):
        b.write_kv("r", LayerKVChunk(0, 0, bad.k[:, :1], bad.v))
    with pytest.raises(ValueError, match="outside"):
        b.write_kv("r", LayerKVChunk(0, len(prompt) - 1, bad.k, bad.v))
    for chunk in chunks[:-1]:
        b.write_kv("r", chunk)
    with pytest.raises(ValueError, match="missing"):
        b.commit_import("r", first)
    b.abort("r")
    run_all(b)
    assert b.kv_stats().blocks_used == 0


def test_import_without_room_raises_no_capacity(tiny_llama_dir):
    b = make_engine(tiny_llama_dir, kv_memory_mb=1, block_size=16)
    params = SamplingParams(max_tokens=300)
    with pytest.raises(NoKVCapacityError):
        for i in range(100):
            b.import_request(str(i), list(range(3, 300)), params)


async def test_async_engine_prefill_import_decode(tiny_dir):
    prefill = AsyncEngine(make_engine(tiny_dir))
    decode = AsyncEngine(make_engine(tiny_dir))
    colocated = AsyncEngine(make_engine(tiny_dir))
    try:
        prompt = list(range(5, 60))
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        handle = await decode.import_kv("r", prompt, params)
        result = None
        async for item in prefill.prefill("r", prompt, params):
            if isinstance(item, LayerKVChunk):
                await handle.write(item)
            else:
                result = item
        got = [t async for out in handle.decode(result.first_token_id) for t in out.new_token_ids]
        want = [t async for out in colocated.generate("r", prompt, params) for t in out.new_token_ids]
        assert got == want and len(got) == 10
        assert decode.kv_stats().blocks_used == 0 and prefill.kv_stats().blocks_used == 0
    finally:
        for e in (prefill, decode, colocated):
            e.shutdown()


async def test_async_consumer_going_away_aborts_and_frees_kv(tiny_llama_dir):
    engine = AsyncEngine(make_engine(tiny_llama_dir))
    try:
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        stream = engine.generate("gone", list(range(3, 50)), params)
        async for _ in stream:
            break  # the client disconnects after the first token
        await stream.aclose()
        deadline = time.monotonic() + 60  # a safety net: the abort reaches the engine thread between steps
        while engine.kv_stats().active_requests != 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        stats = engine.kv_stats()
        assert stats.active_requests == 0 and stats.blocks_used == 0
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in engine.generate("bad", [3], SamplingParams(max_tokens=5000)):
                pass
    finally:
        engine.shutdown()


async def test_async_import_write_errors_surface_before_any_token(tiny_llama_dir):
    decode = AsyncEngine(make_engine(tiny_llama_dir))
    try:
        prompt = list(range(5, 30))
        params = SamplingParams(temperature=0, max_tokens=4)
        handle = await decode.import_kv("bad", prompt, params)
        spec = decode.layer_specs[0]
        k = torch.zeros(len(prompt), spec.num_kv_heads, spec.head_dim)
        await handle.write(LayerKVChunk(99, 0, k, k))  # queued, not awaited: the error comes later
        with pytest.raises(ValueError, match="layer 99"):
            async for _ in handle.decode(7):
                pytest.fail("no token may come from incomplete KV")
        await handle.abort()
        assert decode.kv_stats().blocks_used == 0
    finally:
        decode.shutdown()
