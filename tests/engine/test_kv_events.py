"""Prefix-cache hash events for the scheduler's KV index: the log's protocol, the pool's hooks, and
that what a tiny engine publishes is exactly what a request's prompt hashes to."""

from __future__ import annotations

import random

from crossfill.engine.block_pool import BlockPool, chain_hash, prompt_block_hashes
from crossfill.engine.kv_events import KVEventBatch, KVEventLog
from crossfill.engine.sampling import SamplingParams
from crossfill.policy.kv_index import KVIndex

from .helpers import import_into, make_engine, prefill_remote, run_all

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _h(i: int) -> bytes:
    return chain_hash(b"", "t", [i])


def _prompt(engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, engine.vocab_size) for _ in range(n)]


# --- the log ------------------------------------------------------------------------------------


def test_first_contact_gets_the_full_set_then_deltas_net_of_each_hash() -> None:
    log = KVEventLog()
    log.stored(_h(1))
    log.stored(_h(2))
    for first in (0, -1):
        b = log.since(first)
        assert b.reset and set(b.stored) == {_h(1).hex(), _h(2).hex()} and b.evicted == []
        assert b.next_seq == 3 and b.epoch == log.epoch
    log.evicted(_h(1))
    log.stored(_h(3))
    log.evicted(_h(3))
    log.stored(_h(3))  # evicted, then stored again: only the last event counts
    log.evicted(_h(2))
    d = log.since(3)
    assert not d.reset and d.next_seq == 8
    assert d.stored == [_h(3).hex()] and set(d.evicted) == {_h(1).hex(), _h(2).hex()}
    assert log.since(8) == KVEventBatch(log.epoch, 8, False, [], [])  # nothing new
    wire = {"epoch": log.epoch, "next": 8, "reset": False, "stored": [], "evicted": []}
    assert log.since(8).as_dict() == wire


def test_reset_when_behind_the_ring_from_the_future_or_another_epoch() -> None:
    log = KVEventLog(capacity=4)
    for i in range(6):
        log.stored(_h(i))  # events 1..6; the ring keeps 3..6
    assert not log.since(3).reset
    behind = log.since(2)
    assert behind.reset and len(behind.stored) == 6 and behind.next_seq == 7
    assert log.since(99).reset  # a number from a previous life, past anything this one wrote
    assert log.since(5, epoch="not-this-life").reset
    assert not log.since(5, epoch=log.epoch).reset
    assert KVEventLog().epoch != log.epoch


def test_a_long_backlog_comes_in_bounded_pages_or_as_a_smaller_reset() -> None:
    log = KVEventLog(capacity=100, max_per_answer=4)
    for i in range(10):
        log.stored(_h(i))
    index = KVIndex()
    index.update("w", log.since(0))  # the full set: 10 hashes
    for i in range(10, 16):
        log.stored(_h(i))  # 6 events behind > 4 per answer, but 16 cached: pages, not a reset
    pages = 0
    while (b := log.since(index.next_seq("w"))).next_seq != index.next_seq("w"):
        assert not b.reset and len(b.stored) + len(b.evicted) <= 4
        index.update("w", b)
        pages += 1
    assert pages == 2 and index.blocks("w") == 16
    for i in range(16):
        log.evicted(_h(i))  # 16 events behind, nothing cached: a reset is the smaller answer
    b = log.since(index.next_seq("w"))
    assert b.reset and b.stored == [] and b.next_seq == 33


# --- the pool's hooks -----------------------------------------------------------------------------


def test_pool_reports_registration_and_eviction_once() -> None:
    pool, log = BlockPool(2), KVEventLog()
    a = pool.allocate()
    pool.register(a, _h(0))
    pool.publish_events(log)  # already cached before the log came: seeded as stored
    b = pool.allocate()
    pool.register(b, _h(1))
    pool.register(b, _h(2))  # the block has a hash already: no event
    pool.release(a)
    pool.release(b)
    c = pool.allocate()  # no free block: the least recently used cached one (a) is evicted
    assert c == a
    first = log.since(0)
    assert set(first.stored) == {_h(1).hex()}
    pool.release(c)
    pool.clear_cache()
    assert log.since(0).stored == []
    d = log.since(1)
    assert set(d.stored) == set() and set(d.evicted) == {_h(0).hex(), _h(1).hex()}


# --- the engine -----------------------------------------------------------------------------------


def test_engine_publishes_what_the_prompt_hashes_to(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    bs = engine.block_size
    start = engine.kv_events_since(0)
    assert start.reset and start.stored == [] and start.next_seq == 1
    prompt = _prompt(engine, 5 * bs + 3, seed=1)
    engine.add_request("a", prompt, ONE, namespace="tenant-a")
    run_all(engine)
    got = engine.kv_events_since(start.next_seq)
    assert not got.reset
    assert set(got.stored) == set(prompt_block_hashes(prompt, "tenant-a", bs))
    assert len(got.stored) == 5  # full blocks only; the prompt's tail block is never cached
    # Prefill-only requests (the prefill role) publish the same hashes.
    other = make_engine(tiny_dir)
    chunks, result = prefill_remote(other, "p", prompt, ONE, namespace="tenant-a")
    assert set(other.kv_events_since(0).stored) == set(got.stored)
    assert other.kv_events_since(0).epoch != got.epoch  # each engine life has its own epoch
    # Decode publishes imported KV under its import namespace once the import is committed.
    decode = make_engine(tiny_dir)
    import_into(decode, "d", prompt, ONE, chunks, result.first_token_id, namespace="tenant-a#kv-codec=fp8")
    run_all(decode)
    assert set(decode.kv_events_since(0).stored) == set(prompt_block_hashes(prompt, "tenant-a#kv-codec=fp8", bs))


def test_engine_reports_lru_evictions_and_an_index_following_deltas_stays_exact(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir, kv_memory_mb=1, block_size=4)
    pool = engine.cache.groups[0].pool
    index = KVIndex()
    index.update("w", engine.kv_events_since(0).as_dict())
    evicted = 0
    prompts = [_prompt(engine, 4 * 20 + 1, seed=s) for s in range(2 * pool.num_blocks // 20)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, ONE)
        run_all(engine)
        batch = engine.kv_events_since(index.next_seq("w"))
        evicted += len(batch.evicted)
        index.update("w", batch.as_dict())
    assert evicted > 0, "the pool never had to evict"
    now = {h.hex() for h in pool._block_of}
    assert set(engine.kv_events_since(0).stored) == now
    assert index.blocks("w") == len(now)
    last = prompt_block_hashes(prompts[-1], "", 4)
    assert index.cached_prefix_tokens("w", last, 4) == 4 * 20
    assert index.cached_prefix_tokens("w", prompt_block_hashes(prompts[0], "", 4), 4) == 0  # evicted long ago
