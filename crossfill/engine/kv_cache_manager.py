"""KVCacheManager: block tables, prefix hashing and hits, allocation and freeing.

The scheduler asks for blocks and gets a `KVAllocation` back, or None when they are not free
now; it never edits a block table or a pool itself. Blocks are taken as a sequence grows:
admission takes the prompt's blocks (after prefix-cache hits) in full-attention groups, every
computed chunk takes what it crosses into, and sliding-window groups drop blocks that left their
window after each step. Fully computed blocks are published under their chain hash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from crossfill.engine.attention import export_start, slot_indices
from crossfill.engine.block_pool import NULL_BLOCK, chain_hash
from crossfill.engine.kv_cache import LayerGroup, PagedKVCache
from crossfill.engine.sequence import Sequence


def _sliding(group: LayerGroup) -> bool:
    return group.kind == "sliding" and group.window is not None


@dataclass(frozen=True)
class KVAllocation:
    new_blocks: tuple[int, ...]  # blocks newly taken, per layer group
    cached_tokens: int = 0  # leading tokens whose KV came from the prefix cache


class KVCacheManager:
    def __init__(self, cache: PagedKVCache, *, enable_prefix_caching: bool, max_chunk_tokens: int) -> None:
        self.cache = cache
        self.groups = cache.groups
        self.block_size = cache.block_size
        self.prefix_caching = enable_prefix_caching
        self.max_chunk_tokens = max_chunk_tokens
        self.queries = 0  # admissions that looked up the prefix cache
        self.hits = 0  # ... and found at least one block

    # --- capacity -------------------------------------------------------------------------
    def prefill_blocks(self, num_tokens: int) -> list[int]:
        """Most blocks per group a prefill of `num_tokens` holds at once."""
        return [g.live_blocks_bound(num_tokens, self.block_size, self.max_chunk_tokens) for g in self.groups]

    def never_fits(self, num_tokens: int) -> tuple[LayerGroup, int] | None:
        """(group, blocks needed) when `num_tokens` could not be prefilled even on an empty pool."""
        for group, need in zip(self.groups, self.prefill_blocks(num_tokens), strict=True):
            if need > group.pool.num_blocks:
                return group, need
        return None

    def free_blocks(self) -> list[int]:
        return [g.pool.num_available for g in self.groups]

    # --- allocation -----------------------------------------------------------------------
    def admit(self, seq: Sequence, *, first_admission: bool) -> KVAllocation | None:
        """Take prefix hits and the blocks of `seq.prefill_len` tokens, or nothing if they don't fit.

        Full-attention groups get every prefill block now; sliding groups are checked for their
        bound and take their blocks chunk by chunk (`append_slots`).
        """
        self.hash_blocks(seq, seq.prefill_len)
        best = self._longest_hit(seq)
        self._take_hits(seq, best, [self._hit_first_block(g, best) for g in self.groups])
        bs = self.block_size
        need = []
        for group, bound in zip(self.groups, self.prefill_blocks(seq.prefill_len), strict=True):
            held = sum(b != NULL_BLOCK for b in seq.tables[group.index])
            need.append(max(0, bound - held))
        if any(n > g.pool.num_available for g, n in zip(self.groups, need, strict=True)):
            self.free(seq)
            return None
        new = []
        for group in self.groups:
            upto = best * bs if _sliding(group) else seq.prefill_len
            new.append(self._extend(seq, group, upto))
        seq.num_computed = best * bs
        if first_admission:
            seq.num_cached_tokens = best * bs
            self._count(best)
        return KVAllocation(tuple(new), best * bs)

    def allocate_import(self, seq: Sequence, *, reuse_prefix: bool) -> KVAllocation | None:
        """Blocks for KV arriving from outside: only [export_start, prompt_len) per group, minus hits."""
        n, bs = seq.prompt_len, self.block_size
        best = self._longest_hit(seq) if reuse_prefix else 0
        firsts = [export_start(g, n) // bs for g in self.groups]
        self._take_hits(seq, best, firsts)
        last = (n - 1) // bs
        need = [last + 1 - max(first, best) for first in firsts]
        if any(k > g.pool.num_available for g, k in zip(self.groups, need, strict=True)):
            self.free(seq)
            return None
        new = []
        for group, first in zip(self.groups, firsts, strict=True):
            table = seq.tables[group.index]
            table.extend([NULL_BLOCK] * (first - len(table)))
            new.append(self._extend(seq, group, n))
        seq.num_cached_tokens = best * bs
        if reuse_prefix:
            self._count(best)
        return KVAllocation(tuple(new), best * bs)

    def append_slots(self, seq: Sequence, end: int) -> KVAllocation | None:
        """Blocks so every group's table covers positions [0, end), or None if not free now."""
        need = [max(0, math.ceil(end / self.block_size) - len(seq.tables[g.index])) for g in self.groups]
        if any(k > g.pool.num_available for g, k in zip(self.groups, need, strict=True)):
            return None
        return KVAllocation(tuple(self._extend(seq, g, end) for g in self.groups))

    def reachable_end(self, seq: Sequence) -> int:
        """Largest end position `append_slots` could cover for `seq` with the blocks free now."""
        return min((len(seq.tables[g.index]) + g.pool.num_available) * self.block_size for g in self.groups)

    def free(self, seq: Sequence) -> None:
        for g, block in seq.live_blocks():
            self.groups[g].pool.release(block)
        seq.tables = [[] for _ in self.groups]
        seq.registered = [0] * len(self.groups)

    def after_compute(self, seq: Sequence) -> None:
        """`seq.num_computed` advanced: publish full blocks, drop what left a sliding window."""
        self._publish(seq)
        for group in self.groups:
            if not _sliding(group):
                continue
            table = seq.tables[group.index]
            first_needed = max(0, seq.num_computed - group.window + 1)
            for i in range(min(first_needed // self.block_size, len(table))):
                if table[i] != NULL_BLOCK:
                    group.pool.release(table[i])
                    table[i] = NULL_BLOCK

    def write(self, seq: Sequence, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows of one layer for positions [start, start + len(k)) of `seq`."""
        group = self.cache.layer_group[layer]
        positions = torch.arange(start, start + k.shape[0])
        slots = slot_indices(seq.tables[group.index], positions, self.block_size)
        row = group.local_index[layer]
        group.k[row].index_copy_(0, slots, k.to(group.k.dtype))
        group.v[row].index_copy_(0, slots, v.to(group.v.dtype))

    # --- prefix cache ---------------------------------------------------------------------
    def hash_blocks(self, seq: Sequence, upto: int) -> None:
        if not self.prefix_caching:
            return
        bs = self.block_size
        while (len(seq.hashes) + 1) * bs <= upto:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else b""
            seq.hashes.append(chain_hash(parent, seq.namespace, seq.tokens[i * bs : (i + 1) * bs]))

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def _count(self, best: int) -> None:
        self.queries += 1
        self.hits += best > 0

    def _longest_hit(self, seq: Sequence) -> int:
        """Most leading full blocks held in every group; at least one token is always left over."""
        if not self.prefix_caching:
            return 0
        self.hash_blocks(seq, seq.prefill_len)
        for k in range(min(len(seq.hashes), (seq.prefill_len - 1) // self.block_size), 0, -1):
            if all(self._group_has_prefix(g, seq, k) for g in self.groups):
                return k
        return 0

    def _hit_first_block(self, group: LayerGroup, num_blocks: int) -> int:
        """First block a group must hold for a hit of `num_blocks` (sliding: the window before it)."""
        if _sliding(group):
            return max(0, num_blocks * self.block_size - group.window + 1) // self.block_size
        return 0

    def _group_has_prefix(self, group: LayerGroup, seq: Sequence, k: int) -> bool:
        lo = self._hit_first_block(group, k)
        return all(group.pool.contains(seq.hashes[i]) for i in range(lo, k))

    def _take_hits(self, seq: Sequence, best: int, firsts: list[int]) -> None:
        for group, first in zip(self.groups, firsts, strict=True):
            table = seq.tables[group.index]
            table.extend([NULL_BLOCK] * first)
            for i in range(first, best):
                block = group.pool.lookup(seq.hashes[i])
                assert block is not None
                table.append(block)
            seq.registered[group.index] = best

    def _extend(self, seq: Sequence, group: LayerGroup, upto: int) -> int:
        table = seq.tables[group.index]
        before = len(table)
        while len(table) * self.block_size < upto:
            table.append(group.pool.allocate())
        return len(table) - before

    def _publish(self, seq: Sequence) -> None:
        """Make fully computed blocks findable by later requests with the same prefix."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        self.hash_blocks(seq, full * self.block_size)
        for group in self.groups:
            table = seq.tables[group.index]
            for i in range(seq.registered[group.index], min(full, len(table))):
                if table[i] != NULL_BLOCK:
                    group.pool.register(table[i], seq.hashes[i])
            seq.registered[group.index] = max(seq.registered[group.index], full)
