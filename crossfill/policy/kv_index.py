"""The scheduler's global KV index: which prompt blocks each worker holds in its prefix cache.

Workers publish the chain hashes their prefix cache stores and evicts (crossfill.engine.kv_events,
served with `GET /v1/admin/stats?kv_events_since=N`); the scheduler feeds each answer to
`update` and asks for `next_seq` next time. A request names its prompt's blocks by the same hashes
(crossfill.engine.block_pool.prompt_block_hashes), so `cached_tokens` says how many leading
prompt tokens each instance could take from its cache: the input `decide` ranks instances by.

Pure: no I/O, no clock, no locks (the scheduler's event loop is the only caller). What it holds
is a hint a poll interval old: the engine checks every hit itself, and a claim that no longer
holds costs time, never output.

Restarts: every answer carries the worker's epoch (random per engine life). A delta from an epoch
the index has no full set for cannot be applied to what it held (its numbers restarted), so the
index keeps only what that delta says is stored now (true, possibly incomplete) and asks for a
reset next time (`next_seq` 0). `query_params` also sends the epoch, so a worker that restarted
answers with a reset at once.

Cost: one set of hex hashes per instance, about 120 bytes a block (100 instances x 100k blocks:
1.2 GB measured). A lookup checks leading blocks with C-level set operations and a bisection, so
it costs a set lookup per leading block held, per instance asked: for a 4096-block prompt that
every one of 100 instances holds in full, about 50 ms (the sets do not fit in CPU cache); a miss
at block 0 costs one lookup. Pass `instances` to ask only the ones that can be chosen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from crossfill.engine.kv_events import KVEventBatch


class KVIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[str]] = {}
        self._next: dict[str, int] = {}
        self._epoch: dict[str, str] = {}

    # --- feeding ------------------------------------------------------------------------------
    def update(self, instance: str, kv_events: Mapping[str, Any] | KVEventBatch) -> None:
        """Apply one published batch (the stats body's `kv_events`).

        A malformed batch raises ValueError naming the key, and the instance is forgotten, so the
        next poll asks for a full set instead of building on a state that may have drifted.
        """
        try:
            batch = kv_events if isinstance(kv_events, KVEventBatch) else KVEventBatch.from_dict(kv_events)
        except ValueError:
            self.forget(instance)
            raise
        held = self._blocks.get(instance)
        nxt = batch.next_seq
        if batch.reset:
            self._blocks[instance] = set(batch.stored)
        elif held is None or self._epoch.get(instance) != batch.epoch:
            # A delta against a life we hold no full set of (the worker restarted between polls):
            # what it stores is true, what it leaves out unknown. Keep the former, ask for a reset.
            self._blocks[instance] = set(batch.stored)
            nxt = 0
        else:
            held.difference_update(batch.evicted)  # disjoint from stored: net effect per hash
            held.update(batch.stored)
        self._epoch[instance] = batch.epoch
        self._next[instance] = nxt

    def next_seq(self, instance: str) -> int:
        """The `kv_events_since` to ask `instance` for next; 0 (a full set) when nothing is known."""
        return self._next.get(instance, 0)

    def epoch(self, instance: str) -> str | None:
        return self._epoch.get(instance) or None

    def query_params(self, instance: str) -> dict[str, str]:
        """Query parameters of the next stats poll of `instance`: since where we are, in its epoch."""
        params = {"kv_events_since": str(self.next_seq(instance))}
        epoch = self.epoch(instance)
        if epoch is not None:
            params["kv_epoch"] = epoch
        return params

    def forget(self, instance: str) -> None:
        """Drop an instance (removed, or unreachable long enough that its cache may be gone)."""
        self._blocks.pop(instance, None)
        self._next.pop(instance, None)
        self._epoch.pop(instance, None)

    # --- asking -------------------------------------------------------------------------------
    def instances(self) -> list[str]:
        return sorted(self._blocks)

    def blocks(self, instance: str) -> int:
        """Blocks `instance` is known to hold (for metrics)."""
        return len(self._blocks.get(instance, ()))

    def cached_prefix_tokens(self, instance: str, hashes: Sequence[str], block_size: int) -> int:
        """Tokens of the longest leading run of `hashes` that `instance` holds, in whole blocks.

        The run stops at the first missing hash: the engine reuses only a prefix (block k is
        useless without blocks 0..k-1), and chained hashes make a block after another prefix a
        different hash anyway. The caller caps it below the prompt length if it needs to (the
        engine always computes at least the last token itself).
        """
        held = self._blocks.get(instance)
        return _leading_run(held, list(hashes)) * block_size if held and hashes else 0

    def cached_tokens(self, hashes: Sequence[str], block_size: int,
                      instances: Iterable[str] | None = None) -> dict[str, int]:
        """`cached_prefix_tokens` of every instance (or of `instances`) holding at least one block."""
        if not hashes:
            return {}
        wanted = list(hashes)
        out = {}
        for name in self._blocks if instances is None else instances:
            held = self._blocks.get(name)
            run = _leading_run(held, wanted) if held else 0
            if run > 0:
                out[name] = run * block_size
        return out


def _leading_run(held: set[str], hashes: list[str]) -> int:
    """Length of the longest prefix of `hashes` all in `held`.

    Presence is not monotone (a pool may evict block 0 and keep block 1) but "the first k are all
    held" is, so bisect on k with `issuperset`, which runs in C: about 2n lookups, no Python loop.
    """
    if held.issuperset(hashes):
        return len(hashes)
    lo, hi = 0, len(hashes)  # the first lo are all held; the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if held.issuperset(hashes[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo
