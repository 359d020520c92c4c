"""The scheduler's KV index: applying published batches (deltas, resets, restarts) and matching a
request's prompt hashes against what each instance holds."""

from __future__ import annotations

import pytest

from crossfill.engine.block_pool import prompt_block_hashes
from crossfill.engine.kv_events import KVEventLog
from crossfill.policy.kv_index import KVIndex

BS = 4


def _hashes(tokens: list[int], namespace: str = "") -> list[str]:
    return prompt_block_hashes(tokens, namespace, BS)


def _batch(epoch: str, nxt: int, *, reset: bool = False, stored=(), evicted=()) -> dict:
    return {"epoch": epoch, "next": nxt, "reset": reset, "stored": list(stored), "evicted": list(evicted)}


def test_reset_then_deltas() -> None:
    h = _hashes(list(range(3, 3 + 5 * BS)))
    index = KVIndex()
    assert index.next_seq("a") == 0 and index.query_params("a") == {"kv_events_since": "0"}
    index.update("a", _batch("e1", 4, reset=True, stored=h[:3]))
    assert index.next_seq("a") == 4 and index.blocks("a") == 3
    assert index.query_params("a") == {"kv_events_since": "4", "kv_epoch": "e1"}
    index.update("a", _batch("e1", 7, stored=h[3:5], evicted=[h[0]]))
    assert index.blocks("a") == 4 and index.next_seq("a") == 7
    assert index.cached_prefix_tokens("a", h, BS) == 0  # block 0 is gone: nothing after it counts
    index.update("a", _batch("e1", 9, reset=True, stored=h[:2]))  # a reset replaces everything
    assert index.blocks("a") == 2 and index.cached_prefix_tokens("a", h, BS) == 2 * BS
    index.forget("a")
    assert index.blocks("a") == 0 and index.next_seq("a") == 0 and index.instances() == []


def test_a_delta_from_a_new_epoch_keeps_only_what_it_stores_and_asks_for_a_reset() -> None:
    h = _hashes(list(range(3, 3 + 4 * BS)))
    index = KVIndex()
    index.update("a", _batch("old", 10, reset=True, stored=h[:3]))
    # The worker restarted and its new life already wrote events 1..5: a delta against nothing.
    index.update("a", _batch("new", 6, stored=[h[3]], evicted=[h[0]]))
    assert index.blocks("a") == 1 and index.next_seq("a") == 0
    assert index.cached_prefix_tokens("a", h, BS) == 0
    index.update("a", _batch("new", 6, reset=True, stored=h))
    assert index.cached_prefix_tokens("a", h, BS) == 4 * BS and index.next_seq("a") == 6
    # A delta for an instance never seen (e.g. after forget) is treated the same way.
    index.update("b", _batch("x", 3, stored=[h[0]]))
    assert index.next_seq("b") == 0 and index.blocks("b") == 1


def test_a_malformed_batch_is_refused_and_the_instance_forgotten() -> None:
    index = KVIndex()
    index.update("a", _batch("e", 3, reset=True, stored=_hashes([5] * BS)))
    for bad in ({"epoch": "e", "next": "3", "reset": False}, _batch("e", 3, reset=True, evicted=["ab"]),
                {"epoch": "e", "next": 3, "reset": False, "stored": "abc"}, [1, 2]):
        with pytest.raises(ValueError, match="kv_events"):
            index.update("a", bad)  # type: ignore[arg-type]
        assert index.next_seq("a") == 0 and index.blocks("a") == 0


def test_longest_prefix_stops_at_the_first_missing_hash() -> None:
    h = _hashes(list(range(3, 3 + 8 * BS)))
    index = KVIndex()
    index.update("a", _batch("e", 1, reset=True, stored=[h[0], h[1], h[2], h[4], h[5], h[6], h[7]]))
    assert index.cached_prefix_tokens("a", h, BS) == 3 * BS
    assert index.cached_prefix_tokens("a", h[:2], BS) == 2 * BS
    assert index.cached_prefix_tokens("a", [], BS) == 0
    assert index.cached_prefix_tokens("unknown", h, BS) == 0
    for held in range(len(h) + 1):  # the bisection agrees with a plain walk at every length
        index.update("b", _batch("e", 1, reset=True, stored=h[:held] + h[held + 1 :]))
        assert index.cached_prefix_tokens("b", h, BS) == held * BS


def test_the_same_block_after_another_prefix_or_in_another_namespace_is_not_a_hit() -> None:
    shared = list(range(100, 100 + 2 * BS))
    a = list(range(3, 3 + BS)) + shared
    b = list(range(50, 50 + BS)) + shared  # same tokens in blocks 1 and 2, after another block 0
    index = KVIndex()
    index.update("w", _batch("e", 1, reset=True, stored=_hashes(a, "tenant-1")))
    assert index.cached_prefix_tokens("w", _hashes(a, "tenant-1"), BS) == 3 * BS
    assert set(_hashes(b, "tenant-1")).isdisjoint(_hashes(a, "tenant-1"))
    assert index.cached_prefix_tokens("w", _hashes(b, "tenant-1"), BS) == 0
    assert index.cached_prefix_tokens("w", _hashes(a, "tenant-2"), BS) == 0
    assert index.cached_prefix_tokens("w", _hashes(a), BS) == 0


def test_cached_tokens_names_only_instances_holding_a_prefix() -> None:
    h = _hashes(list(range(3, 3 + 6 * BS)))
    index = KVIndex()
    index.update("p0", _batch("e", 1, reset=True, stored=h))
    index.update("p1", _batch("e", 1, reset=True, stored=h[:2]))
    index.update("p2", _batch("e", 1, reset=True, stored=h[1:]))  # no block 0: nothing reusable
    index.update("d0", _batch("e", 1, reset=True))
    assert index.cached_tokens(h, BS) == {"p0": 6 * BS, "p1": 2 * BS}
    assert index.cached_tokens(h, BS, instances=["p1", "p2", "nobody"]) == {"p1": 2 * BS}
    assert index.cached_tokens([], BS) == {}
    assert index.instances() == ["d0", "p0", "p1", "p2"] and index.blocks("p2") == 5


def test_prompt_hashes_cap_and_namespaces() -> None:
    tokens = list(range(3, 3 + 10 * BS + 1))
    full = _hashes(tokens)
    assert len(full) == 10 and all(len(x) == 32 and int(x, 16) >= 0 for x in full)
    assert prompt_block_hashes(tokens, "", BS, max_blocks=4) == full[:4]
    assert prompt_block_hashes(tokens[: BS - 1], "", BS) == []
    assert _hashes(tokens, "t") != full


def test_an_index_fed_by_a_live_log_ends_with_exactly_its_set() -> None:
    log = KVEventLog(capacity=8, max_per_answer=3)
    index = KVIndex()
    h = _hashes(list(range(3, 3 + 30 * BS)))
    kinds = []
    for step in range(30):
        log.stored(bytes.fromhex(h[step]))
        if step % 3 == 2:
            log.evicted(bytes.fromhex(h[step - 2]))
        if step % 2 and not 10 <= step < 20:  # polls lag the writes, once past the ring buffer
            b = log.since(index.next_seq("w"), index.epoch("w"))
            kinds.append(b.reset)
            index.update("w", b)
    for _ in range(10):  # catch up: pages of at most 3 events
        b = log.since(index.next_seq("w"), index.epoch("w"))
        index.update("w", b)
        if not (b.reset or b.stored or b.evicted):
            break
    assert kinds.count(True) == 2  # the first contact and the poll after the gap
    held = {x for x in h if index.cached_prefix_tokens("w", [x], BS)}
    assert held == set(log.since(0).stored) and index.blocks("w") == len(held)
