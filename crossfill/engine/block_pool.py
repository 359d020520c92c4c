"""Fixed-size KV block allocation with reference counts and a hash-addressed prefix cache.

One pool per layer group (all full-attention layers share one, all sliding-window layers
another), so a sliding group can drop blocks that left its window while the full group keeps
them. A block whose last reference goes away stays in the pool as *cached* (reusable by a later
request with the same prefix hash) until it is evicted, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

NULL_BLOCK = -1


def chain_hash(parent: bytes, namespace: str, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Hash of one full block, chained on its parent so equal blocks after different prefixes differ.

    The namespace (tenant) salts the chain, so tenants never share cached KV.
    """
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(namespace.encode())
    h.update(b"\x00")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"KV block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks

    # --- accounting -------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks that an allocation can take now (free or evictable)."""
        return len(self._free) + len(self._lru)

    # --- allocation -------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            self._forget(block)
        else:
            raise RuntimeError("KV block pool exhausted (admission control should have prevented this)")
        self._refs[block] = 1
        return block

    def release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if self._refs[block] < 0:
            raise RuntimeError(f"KV block {block} released twice")
        if block in self._hash_of:
            self._lru[block] = None
        else:
            self._free.append(block)

    # --- prefix cache -----------------------------------------------------------------------
    def register(self, block: int, block_hash: bytes) -> None:
        """Make a fully written block findable by its chain hash (first writer wins)."""
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block for a hash, with a new reference taken, or None."""
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        if self._refs[block] == 0:
            self._lru.pop(block, None)
        self._refs[block] += 1
        return block

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._block_of

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            self._block_of.pop(block_hash, None)

    def clear_cache(self) -> None:
        """Drop every cached, unreferenced block (e.g. on a weight reload)."""
        while self._lru:
            block, _ = self._lru.popitem(last=False)
            self._forget(block)
            self._free.append(block)
