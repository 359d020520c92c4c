"""Simulated prefix caches: one LRU per instance (capacity in tokens) and an index of holders.

An instance's cache maps a prefix key (see `workload`) to the tokens of it that it holds. The
`HolderIndex` answers "which instances hold key k" in O(1) and picks a few of them at random, so
the candidate snapshot can include the instances with a request's prefix without scanning 1,000
caches; random picks among many holders keep a popular shared prefix from pinning its traffic to
whichever instance happened to cache it first.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class Holders(Generic[T]):
    """A set with O(1) add, remove and random choice."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.pos: dict[int, int] = {}

    def add(self, item: T) -> None:
        if id(item) not in self.pos:
            self.pos[id(item)] = len(self.items)
            self.items.append(item)

    def remove(self, item: T) -> None:
        i = self.pos.pop(id(item), None)
        if i is None:
            return
        last = self.items.pop()
        if last is not item:
            self.items[i] = last
            self.pos[id(last)] = i

    def pick(self, k: int, rng: random.Random) -> list[T]:
        n = len(self.items)
        if n <= k:
            return list(self.items)
        return [self.items[i] for i in rng.sample(range(n), k)]


class HolderIndex(Generic[T]):
    """key -> the instances whose cache holds it."""

    def __init__(self) -> None:
        self.by_key: dict[int, Holders[T]] = {}

    def add(self, key: int, inst: T) -> None:
        h = self.by_key.get(key)
        if h is None:
            h = self.by_key[key] = Holders()
        h.add(inst)

    def remove(self, key: int, inst: T) -> None:
        h = self.by_key.get(key)
        if h is not None:
            h.remove(inst)
            if not h.items:
                del self.by_key[key]

    def pick(self, key: int, k: int, rng: random.Random) -> list[T]:
        h = self.by_key.get(key)
        return h.pick(k, rng) if h is not None else []


class PrefixCache(Generic[T]):
    """LRU over prefix keys, bounded by the tokens held; keeps `index` in step for its owner."""

    __slots__ = ("owner", "capacity", "used", "entries", "index")

    def __init__(self, owner: T, capacity_tokens: int, index: HolderIndex[T]) -> None:
        self.owner = owner
        self.capacity = capacity_tokens
        self.used = 0
        self.entries: OrderedDict[int, int] = OrderedDict()
        self.index = index

    def hit(self, key: int, limit: int) -> int:
        """Tokens of `key` held (at most `limit`); a hit refreshes the entry."""
        held = self.entries.get(key)
        if not held:
            return 0
        self.entries.move_to_end(key)
        return held if held < limit else limit

    def peek(self, key: int) -> int:
        return self.entries.get(key, 0)

    def put(self, key: int, tokens: int) -> None:
        if tokens <= 0 or tokens > self.capacity:
            return
        entries = self.entries
        old = entries.get(key)
        if old is not None:
            if tokens <= old:
                entries.move_to_end(key)
                return
            self.used -= old
        else:
            self.index.add(key, self.owner)
        entries[key] = tokens
        entries.move_to_end(key)
        self.used += tokens
        while self.used > self.capacity:
            victim, size = entries.popitem(last=False)
            self.used -= size
            self.index.remove(victim, self.owner)

    def clear(self) -> None:
        for key in self.entries:
            self.index.remove(key, self.owner)
        self.entries.clear()
        self.used = 0
