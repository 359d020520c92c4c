"""Engine behaviour a user relies on: batching, prefix cache, admission, sampling, streaming, errors."""

from __future__ import annotations

import random

import pytest

from crossfill.engine.sampling import SamplingParams

from .helpers import make_engine, run_all, tokens_of

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(engine, n=4, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def _alone(path, prompt, params=GREEDY, **kw):
    engine = make_engine(path, **kw)
    engine.add_request("x", prompt, params)
    return tokens_of(run_all(engine)["x"])


def test_continuous_batching_and_chunking_do_not_change_outputs(tiny_dir):
    engine = make_engine(tiny_dir)
    prompts = _prompts(engine)
    engine.add_request("0", prompts[0], GREEDY)
    engine.step()
    engine.step()  # request 0 is mid-flight when the others join
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), p, GREEDY)
    outs = run_all(engine)
    for i, p in enumerate(prompts):
        alone = _alone(tiny_dir, p, max_num_batched_tokens=512, block_size=16)
        assert tokens_of(outs[str(i)]) == alone


def test_prefix_cache_reuses_blocks_within_a_namespace_only(tiny_dir):
    engine = make_engine(tiny_dir)
    prompt = _prompts(engine, 1, seed=3)[0] + list(range(3, 43))
    engine.add_request("a", prompt, GREEDY, namespace="tenant-a")
    first = run_all(engine)["a"]
    engine.add_request("b", prompt, GREEDY, namespace="tenant-a")
    again = run_all(engine)["b"]
    engine.add_request("c", prompt, GREEDY, namespace="tenant-b")
    other = run_all(engine)["c"]
    assert first[-1].num_cached_tokens == 0
    assert again[-1].num_cached_tokens >= len(prompt) - 2 * engine.cfg.block_size
    assert other[-1].num_cached_tokens == 0, "another tenant must not hit tenant-a's cache"
    assert tokens_of(first) == tokens_of(again) == tokens_of(other)


def test_request_that_can_never_fit_is_refused_with_the_limit(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, kv_memory_mb=1, block_size=16)
    with pytest.raises(ValueError, match="kv_memory_mb"):
        engine.add_request("big", [5] * 1500, SamplingParams(max_tokens=500))


def test_abort_frees_every_block(tiny_dir):
    engine = make_engine(tiny_dir)
    idle = engine.kv_stats()
    prompts = _prompts(engine, 3, seed=7)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_stats().blocks_used > 0
    for i in range(3):
        assert engine.abort(str(i))
    outs = run_all(engine)
    assert all(outs[str(i)][-1].finish_reason == "abort" for i in range(3))
    stats = engine.kv_stats()
    assert stats.blocks_used == idle.blocks_used == 0 and stats.active_requests == 0


def test_stop_conditions(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = _prompts(engine, 1, seed=11)[0]
    base = _alone(tiny_llama_dir, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("len", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.add_request("tok", prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[base[3]],
                                                     ignore_eos=True))
    outs = run_all(engine)
    assert tokens_of(outs["len"]) == base[:5] and outs["len"][-1].finish_reason == "length"
    stopped = tokens_of(outs["tok"])
    assert stopped == base[: base.index(base[3]) + 1] and outs["tok"][-1].finish_reason == "stop"
    # a stop string: text ends right before it and never contains it
    full_text = "".join(d.new_text for d in run_all_one(tiny_llama_dir, prompt, 12))
    middle = len(full_text) // 2
    at = next(i for i in range(middle, len(full_text) - 1) if full_text[i : i + 2].strip() == full_text[i : i + 2])
    stop = full_text[at : at + 2]
    engine.add_request("str", prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))
    deltas = run_all(engine)["str"]
    text = "".join(d.new_text for d in deltas)
    assert text == full_text[: full_text.index(stop)] and deltas[-1].finish_reason == "stop"


def run_all_one(path, prompt, n):
    engine = make_engine(path)
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return run_all(engine)["x"]


def test_streamed_text_is_never_broken_utf8(tiny_llama_dir):
    from crossfill.engine.detokenizer import IncrementalDetokenizer

    tok = make_engine(tiny_llama_dir).tokenizer
    text = "Ünïcödé 🚀 text, emojis 🚀🚀 and ü"
    ids = tok.encode(text)
    assert len(ids) > len(text.split()), "the tiny tokenizer must split multi-byte characters"
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), stop=[])
    deltas = []
    for token in ids:
        detok.add(token)
        deltas.append(detok.take(final=False))
    deltas.append(detok.take(final=True))
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == text


def test_streamed_deltas_concatenate_to_the_full_decode(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    tok = engine.tokenizer
    engine.add_request("u", tok.encode("emojis 🚀 and"), SamplingParams(temperature=1.0, seed=1, max_tokens=60,
                                                                        ignore_eos=True))
    deltas = run_all(engine)["u"]
    ids = tokens_of(deltas)
    assert "".join(d.new_text for d in deltas) == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = _prompts(engine, 1, seed=13)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    engine.add_request("s1", prompt, seeded)
    engine.add_request("s2", prompt, seeded)
    engine.add_request("k1", prompt, SamplingParams(temperature=0.7, top_k=1, max_tokens=20, ignore_eos=True))
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    outs = run_all(engine)
    assert tokens_of(outs["s1"]) == tokens_of(outs["s2"])
    assert tokens_of(outs["k1"]) == tokens_of(outs["g"])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_prompt_beyond_context_names_the_limit(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, kv_memory_mb=64)
    with pytest.raises(ValueError, match="context of 2048 tokens"):
        engine.add_request("long", [5] * 2040, SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
