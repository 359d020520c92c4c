"""KV memory on demand: admission takes the prompt's blocks, decoding grows one block at a time,
and under pressure the least protected request is preempted and recomputed, with unchanged output."""

from __future__ import annotations

import random

import pytest
import torch

from crossfill.engine.sampling import SamplingParams
from crossfill.engine.sequence import Mode, Status
from crossfill.engine.types import NoKVCapacityError

from .helpers import import_into, make_engine, prefill_remote, run_all, tokens_of

TIGHT = dict(kv_memory_mb=1, block_size=16, max_num_batched_tokens=64)
ROOMY = dict(kv_memory_mb=64, block_size=16, max_num_batched_tokens=64)


def _prompts(vocab: int, n: int, seed: int, lo: int = 20, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _full_pool_tokens(engine) -> int:
    return min(g.pool.num_blocks for g in engine.cache.groups if g.kind == "full") * engine.cfg.block_size


def _run_checking_victims(engine) -> dict[str, list]:
    """Step to the end; after any step that preempted an imported request, no colocated one may run."""
    outs: dict[str, list] = {}
    seen = {id(s): s.num_preemptions for s in engine.requests.values()}
    while engine.has_unfinished():
        tracked = list(engine.requests.values())
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        for seq in tracked:
            assert not (seq.mode == Mode.PREFILL_ONLY and seq.num_preemptions), "prefill-only was preempted"
            if seq.num_preemptions > seen.get(id(seq), 0) and seq.mode == Mode.DECODE_ONLY:
                assert not any(s.mode == Mode.COLOCATED for s in engine.running), "imported preempted first"
            seen[id(seq)] = seq.num_preemptions
        assert engine.cache.blocks_used <= engine.cache.blocks_total
    return outs


def test_preemption_keeps_outputs_identical(tiny_dir):
    """Imported and colocated requests (greedy, seeded, stop string) on a pool far too small."""
    ref, tight, prefill = make_engine(tiny_dir, **ROOMY), make_engine(tiny_dir, **TIGHT), make_engine(tiny_dir)
    n = 8
    new = min(2 * _full_pool_tokens(tight) // n, 400)  # the worst cases add up to > 1.3x the pool
    prompts = _prompts(tight.vocab_size, n, seed=1)
    params = [
        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=new, ignore_eos=True),
    ]
    for i, prompt in enumerate(prompts):
        ref.add_request(str(i), prompt, params[i % 2])
    want = run_all(ref)
    for i in (0, 1):  # two imported (decode-only) requests, admitted first
        chunks, result = prefill_remote(prefill, str(i), prompts[i], params[i % 2])
        import_into(tight, str(i), prompts[i], params[i % 2], chunks, result.first_token_id)
    for i in range(2, n):
        tight.add_request(str(i), prompts[i], params[i % 2])
    got = _run_checking_victims(tight)
    stats = tight.kv_stats()
    assert stats.preemptions > 0 and stats.as_dict()["preemptions"] == stats.preemptions
    assert stats.out_of_kv_finishes == 0
    for i in range(n):
        assert tokens_of(got[str(i)]) == tokens_of(want[str(i)]), f"request {i}"
        assert "".join(d.new_text for d in got[str(i)]) == "".join(d.new_text for d in want[str(i)])
        assert got[str(i)][-1].finish_reason == "length"
    assert stats.blocks_used == 0 and stats.active_requests == 0


def test_stop_string_survives_a_preemption(tiny_llama_dir):
    ref, tight = make_engine(tiny_llama_dir, **ROOMY), make_engine(tiny_llama_dir, **TIGHT)
    prompts = _prompts(tight.vocab_size, 4, seed=2)
    long = SamplingParams(temperature=1.0, seed=3, max_tokens=400, ignore_eos=True)
    ref.add_request("s", prompts[0], long)
    text = "".join(d.new_text for d in run_all(ref)["s"])
    at = next(i for i in range(len(text) * 3 // 4, len(text) - 3) if text.index(text[i : i + 3]) == i)
    stop = SamplingParams(temperature=1.0, seed=3, max_tokens=400, stop=[text[at : at + 3]], ignore_eos=True)
    ref.add_request("s", prompts[0], stop)
    want = run_all(ref)["s"]
    for i, prompt in enumerate(prompts[1:]):
        tight.add_request(f"o{i}", prompt, long)
    tight.add_request("s", prompts[0], stop)  # the youngest: the first to give its blocks back
    seq = tight.requests["s"]
    got = run_all(tight)["s"]
    assert tight.requests == {} and seq.num_preemptions > 0
    assert tokens_of(got) == tokens_of(want) and got[-1].finish_reason == "stop"
    assert "".join(d.new_text for d in got) == "".join(d.new_text for d in want) == text[:at]


def test_imported_requests_are_preempted_and_recomputed(tiny_llama_dir):
    ref, tight, prefill = (make_engine(tiny_llama_dir, **ROOMY), make_engine(tiny_llama_dir, **TIGHT),
                           make_engine(tiny_llama_dir))
    n = 3
    params = SamplingParams(temperature=0, max_tokens=2 * _full_pool_tokens(tight) // n, ignore_eos=True)
    prompts = _prompts(tight.vocab_size, n, seed=3)
    seqs = []
    for i, prompt in enumerate(prompts):
        chunks, result = prefill_remote(prefill, str(i), prompt, params)
        seqs.append(import_into(tight, str(i), prompt, params, chunks, result.first_token_id))
        ref.add_request(str(i), prompt, params)
    want, got = run_all(ref), _run_checking_victims(tight)
    assert seqs[-1].num_preemptions > 0, "the youngest import gives its blocks back first"
    assert seqs[0].num_preemptions == 0
    for i in range(n):
        assert tokens_of(got[str(i)]) == tokens_of(want[str(i)])
        assert got[str(i)][-1].completion_tokens == params.max_tokens


def test_requests_without_max_tokens_are_all_admitted(tiny_dir):
    """16 requests asking for the rest of the context share a pool that holds ~2 such worst cases."""
    engine = make_engine(tiny_dir, kv_memory_mb=2, block_size=16, max_num_seqs=16, max_num_batched_tokens=1024)
    assert _full_pool_tokens(engine) < 3 * engine.max_model_len
    prompts = _prompts(engine.vocab_size, 16, seed=4)
    for i, prompt in enumerate(prompts):
        rest = SamplingParams(temperature=0, max_tokens=engine.max_model_len - len(prompt), ignore_eos=True)
        engine.add_request(str(i), prompt, rest)
    outs: dict[str, list] = {}
    for _ in range(5):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert len(engine.running) == 16 and not engine.waiting
    assert all(len(tokens_of(outs[str(i)])) == 5 for i in range(16))
    assert engine.kv_stats().preemptions == 0
    decode = make_engine(tiny_dir, kv_memory_mb=2, block_size=16, max_num_seqs=16)
    for i, prompt in enumerate(prompts):  # the same on a decode instance: imports hold only the prompt
        decode.import_request(str(i), prompt, SamplingParams(max_tokens=decode.max_model_len - len(prompt)))
    with pytest.raises(NoKVCapacityError, match="max_num_seqs"):
        decode.import_request("17", prompts[0], SamplingParams(max_tokens=5))
    for i in range(16):
        assert engine.abort(str(i)) and decode.abort(str(i))
    run_all(engine)
    assert engine.kv_stats().blocks_used == 0 and decode.kv_stats().blocks_used == 0


def test_lone_request_that_cannot_grow_ends_with_length(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, **TIGHT)
    pool = _full_pool_tokens(engine)
    prompt = _prompts(engine.vocab_size, 1, seed=5, lo=pool - 24, hi=pool - 23)[0]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("big", prompt, params)
    got = run_all(engine)["big"]
    assert got[-1].finished and got[-1].finish_reason == "length"
    generated = tokens_of(got)
    assert len(prompt) + len(generated) == pool + 1  # every position of the pool holds KV; one more was sampled
    assert engine.kv_stats().out_of_kv_finishes == 1 and engine.kv_stats().blocks_used == 0
    ref = make_engine(tiny_llama_dir, **ROOMY)
    ref.add_request("big", prompt, params)
    assert tokens_of(run_all(ref)["big"])[: len(generated)] == generated


def test_prompt_that_could_never_fit_is_refused_at_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, **TIGHT)
    pool = _full_pool_tokens(engine)
    with pytest.raises(ValueError, match=r"\d+-token prompt needs \d+ KV blocks .* has \d+: raise kv_memory_mb"):
        engine.add_request("huge", [5] * (pool + 1), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="kv_memory_mb"):
        engine.import_request("huge", [5] * (pool + 1), SamplingParams(max_tokens=1))
    engine.import_request("a", [5] * (pool - 16), SamplingParams(max_tokens=1000))  # fits, nothing else does
    with pytest.raises(NoKVCapacityError, match="32-token prompt"):
        engine.import_request("b", [6] * 32, SamplingParams(max_tokens=1))
    assert engine.requests["a"].status == Status.IMPORTING


def test_prefill_only_requests_wait_for_blocks_and_are_never_preempted(tiny_dir):
    tight, roomy = make_engine(tiny_dir, **TIGHT), make_engine(tiny_dir, **ROOMY)
    pool = _full_pool_tokens(tight)
    prompts = _prompts(tight.vocab_size, 6, seed=6, lo=pool // 4, hi=pool // 3)
    params = SamplingParams(temperature=0, max_tokens=1)
    long = SamplingParams(temperature=0, max_tokens=min(pool // 2, 300), ignore_eos=True)
    exported: dict[str, list] = {}
    tight.add_request("colo", prompts[0][:40], long)
    early = [out for _ in range(3) for out in tight.step()]  # decoding when the prefill-only ones arrive
    for i, prompt in enumerate(prompts):
        tight.add_request(f"p{i}", prompt, params, prefill_only=True,
                          kv_sink=exported.setdefault(f"p{i}", []).append)
    got = _run_checking_victims(tight)
    assert tight.kv_stats().blocks_used == 0
    roomy.add_request("colo", prompts[0][:40], long)
    assert tokens_of(early + got["colo"]) == tokens_of(run_all(roomy)["colo"])
    for i, prompt in enumerate(prompts):
        want = prefill_remote(roomy, f"p{i}", prompt, params)[0]
        assert got[f"p{i}"][-1].prefill is not None
        for spec in tight.layer_specs:  # chunk boundaries differ with the batch; the KV does not
            mine = [c for c in exported[f"p{i}"] if c.layer == spec.index]
            ref = [c for c in want if c.layer == spec.index]
            assert all(a.end == b.start for a, b in zip(mine, mine[1:], strict=False))
            assert (mine[0].start, mine[-1].end) == (ref[0].start, ref[-1].end) == (mine[0].start, len(prompt))
            torch.testing.assert_close(torch.cat([c.v for c in mine]), torch.cat([c.v for c in ref]),
                                       atol=1e-4, rtol=1e-4)
