"""Reuse across the wire: decode keeps the prefix it already holds (`reuse_prefix`), prefill sends
only what decode lacks (`export_from`) and reuses its own prefix cache; outputs equal colocated."""

from __future__ import annotations

import random

import pytest
import torch

from crossfill.engine.async_engine import AsyncEngine
from crossfill.engine.attention import export_start, slot_indices
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import LayerKVChunk

from .helpers import import_into, make_engine, prefill_remote, run_all, tokens_of

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, engine.vocab_size) for _ in range(n)]


def _colocated(path, prompt, params=GREEDY) -> list[int]:
    engine = make_engine(path)
    engine.add_request("c", prompt, params)
    return tokens_of(run_all(engine)["c"])


def _held_rows(engine, seq, upto: int) -> list[torch.Tensor]:
    rows = []
    for group in engine.cache.groups:
        lo = export_start(group, seq.prompt_len)
        if lo < upto:
            slots = slot_indices(seq.tables[group.index], torch.arange(lo, upto), engine.cfg.block_size)
            rows.append(group.k[:, slots].clone())
    return rows


def test_second_turn_imports_only_what_decode_lacks(tiny_dir):
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    bs = decode.cfg.block_size
    turn1 = _tokens(decode, 70, seed=1)
    chunks, result = prefill_remote(prefill, "t1", turn1, GREEDY, namespace="ns")
    seq1 = import_into(decode, "t1", turn1, GREEDY, chunks, result.first_token_id, namespace="ns",
                       reuse_prefix=True)
    assert seq1.num_cached_tokens == 0
    out1 = tokens_of(run_all(decode)["t1"])
    turn2 = turn1 + out1 + _tokens(decode, 15, seed=2)
    want = _colocated(tiny_dir, turn2)

    seq2 = decode.import_request("t2", turn2, GREEDY, namespace="ns", reuse_prefix=True)
    cached = seq2.num_cached_tokens
    assert cached == (len(turn1) + len(out1) - 1) // bs * bs  # every block decode computed in turn 1
    assert decode.prefix_cache_hit_rate() == 0.5
    held = _held_rows(decode, seq2, cached)
    chunks, result = prefill_remote(prefill, "t2", turn2, GREEDY, namespace="ns", export_from=cached)
    assert result.num_cached_tokens == (len(turn1) - 1) // bs * bs  # prefill's own hits, below decode's
    assert min(c.start for c in chunks) == cached
    full_layer = next(s.index for s in decode.layer_specs if s.kind == "full")
    spec = decode.layer_specs[full_layer]
    garbage = torch.full((cached, spec.num_kv_heads, spec.head_dim), 1e4)
    decode.write_kv("t2", LayerKVChunk(full_layer, 0, garbage, garbage))  # entirely below: a no-op
    for chunk in chunks:
        decode.write_kv("t2", chunk)
    assert all(torch.equal(a, b) for a, b in zip(held, _held_rows(decode, seq2, cached), strict=True))
    decode.commit_import("t2", result.first_token_id)
    got = run_all(decode)["t2"]
    assert tokens_of(got) == want and got[-1].num_cached_tokens == cached

    # A sender that fell back to sending everything: rows below the held prefix are dropped.
    chunks, result = prefill_remote(prefill, "t3", turn2, GREEDY, namespace="ns")
    assert result.num_cached_tokens > cached  # prefill now holds turn 2 itself
    seq3 = decode.import_request("t3", turn2, GREEDY, namespace="ns", reuse_prefix=True)
    assert seq3.num_cached_tokens >= cached
    held = _held_rows(decode, seq3, seq3.num_cached_tokens)
    for chunk in chunks:
        decode.write_kv("t3", chunk)
    assert all(torch.equal(a, b) for a, b in zip(held, _held_rows(decode, seq3, seq3.num_cached_tokens),
                                                  strict=True))
    decode.commit_import("t3", result.first_token_id)
    assert tokens_of(run_all(decode)["t3"]) == want
    assert decode.kv_stats().blocks_used == 0


def test_reuse_is_per_namespace_and_off_by_default(tiny_llama_dir):
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    prompt = _tokens(decode, 50, seed=3)
    chunks, result = prefill_remote(prefill, "a", prompt, GREEDY)
    import_into(decode, "a", prompt, GREEDY, chunks, result.first_token_id, namespace="x", reuse_prefix=True)
    run_all(decode)
    assert decode.import_request("b", prompt, GREEDY, namespace="y", reuse_prefix=True).num_cached_tokens == 0
    assert decode.import_request("c", prompt, GREEDY, namespace="x").num_cached_tokens == 0
    seq = decode.import_request("d", prompt, GREEDY, namespace="x", reuse_prefix=True)
    assert seq.num_cached_tokens == (len(prompt) - 1) // 4 * 4  # the last prompt token always comes over
    with pytest.raises(ValueError, match="missing from token 48"):
        decode.commit_import("d", result.first_token_id)


@pytest.mark.parametrize(("warm", "export_from"), [(0, 37), (60, 30), (60, 75), (60, 90)])
def test_prefill_exports_exactly_from_export_from(tiny_dir, warm, export_from):
    engine, fresh = make_engine(tiny_dir), make_engine(tiny_dir)
    prompt = _tokens(engine, 100, seed=4)
    if warm:
        prefill_remote(engine, "warm", prompt[:warm], GREEDY)
    chunks, result = prefill_remote(engine, "r", prompt, GREEDY, export_from=export_from)
    assert result.num_cached_tokens == warm
    whole, reference = prefill_remote(fresh, "r", prompt, GREEDY)
    assert result.first_token_id == reference.first_token_id
    for spec in engine.layer_specs:
        lo = max(export_start(engine.cache.layer_group[spec.index], len(prompt)), export_from)
        mine = [c for c in chunks if c.layer == spec.index]
        assert mine[0].start == lo and mine[-1].end == len(prompt)
        assert all(a.end == b.start for a, b in zip(mine, mine[1:], strict=False)), "token order, no gaps"
        ref = torch.cat([c.k for c in whole if c.layer == spec.index])
        first = min(c.start for c in whole if c.layer == spec.index)
        torch.testing.assert_close(torch.cat([c.k for c in mine]), ref[lo - first :], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", [-1, 100, 1000, 2.5])
def test_export_from_outside_the_prompt_is_refused(tiny_llama_dir, bad):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="export_from"):
        engine.add_request("r", list(range(3, 103)), GREEDY, prefill_only=True, kv_sink=lambda c: None,
                           export_from=bad)
    assert not engine.has_unfinished()


async def test_async_reuse_and_export_from(tiny_dir):
    prefill, decode = AsyncEngine(make_engine(tiny_dir)), AsyncEngine(make_engine(tiny_dir))
    try:
        async def remote(rid, prompt):
            handle = await decode.import_kv(rid, prompt, GREEDY, namespace="t", reuse_prefix=True)
            result = None
            async for item in prefill.prefill(rid, prompt, GREEDY, namespace="t", export_from=handle.cached_tokens):
                if isinstance(item, LayerKVChunk):
                    assert item.start >= handle.cached_tokens
                    await handle.write(item)
                else:
                    result = item
            out = [t async for o in handle.decode(result.first_token_id) for t in o.new_token_ids]
            return handle.cached_tokens, out

        turn1 = list(range(5, 60))
        cached1, out1 = await remote("1", turn1)
        turn2 = turn1 + out1 + list(range(70, 80))
        cached2, out2 = await remote("2", turn2)
        assert cached1 == 0 and cached2 > len(turn1)
        assert out1 == _colocated(tiny_dir, turn1) and out2 == _colocated(tiny_dir, turn2)
        assert decode.kv_stats().blocks_used == 0 and prefill.kv_stats().blocks_used == 0
    finally:
        prefill.shutdown()
        decode.shutdown()
