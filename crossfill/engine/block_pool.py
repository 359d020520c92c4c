"""Fixed-size KV block allocation with reference counts and a hash-addressed prefix cache.

One pool per layer group (all full-attention layers share one, all sliding-window layers
another), so a sliding group can drop blocks that left its window while the full group keeps
them. A block whose last reference goes away stays in the pool as *cached* (reusable by a later
request with the same prefix hash) until it is evicted, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from crossfill.engine.kv_events import KVEventLog

NULL_BLOCK = -1
# The engine's default block size, also what the gateway hashes a prompt with for the KV index:
# one constant, so the request's hashes and the workers' published hashes use the same blocks.
DEFAULT_BLOCK_SIZE = 16


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


def prompt_block_hashes(
    token_ids: Sequence[int], namespace: str, block_size: int = DEFAULT_BLOCK_SIZE, *,
    max_blocks: int | None = None,
) -> list[str]:
    """Hex chain hashes of the prompt's full blocks, as the engine registers them in `namespace`.

    What the scheduler's KV index matches against the hashes workers publish
    (crossfill.engine.kv_events); the last partial block is never cached, so it has no hash.
    `max_blocks` keeps only the first blocks (a cap on what a route query carries).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max(0, max_blocks))
    out: list[str] = []
    parent = b""
    for i in range(n):
        parent = chain_hash(parent, namespace, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        out.append(parent.hex())
    return out


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
        self.events: KVEventLog | None = None  # hashes registered/forgotten, for the scheduler's KV index

    def publish_events(self, log: KVEventLog) -> None:
        """Report every hash registered or forgotten from now on to `log` (those held now as stored)."""
        log.seed(self._block_of)
        self.events = log

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
        if self.events is not None:
            self.events.stored(block_hash)

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
            if self.events is not None:
                self.events.evicted(block_hash)

    def clear_cache(self) -> None:
        """Drop every cached, unreferenced block (e.g. on a weight reload)."""
        while self._lru:
            block, _ = self._lru.popitem(last=False)
            self._forget(block)
            self._free.append(block)
