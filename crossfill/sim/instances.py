"""Simulated instances: what each one is doing now, in plain mutable slots (one object per
instance, never per request). The frozen `InstanceState` that `decide` reads is made from these
only for the few candidates of each decision (`snapshot`)."""

from __future__ import annotations

from collections import deque

from crossfill.sim.cache import HolderIndex, PrefixCache
from crossfill.sim.costs import PrefillTime


class PrefillInstance:
    """A FIFO prefill server: one prompt at a time, `queue` behind it."""

    __slots__ = ("idx", "name", "datacenter", "remote", "time", "tokens_per_s", "capacity", "queue", "busy",
                 "current", "up", "epoch", "cache")

    def __init__(self, idx: int, name: str, datacenter: str, remote: bool, time: PrefillTime,
                 tokens_per_s: float, capacity: int, cache_tokens: int, index: HolderIndex) -> None:
        self.idx, self.name, self.datacenter, self.remote = idx, name, datacenter, remote
        self.time, self.tokens_per_s, self.capacity = time, tokens_per_s, capacity
        self.queue: deque[int] = deque()
        self.busy = False
        self.current = -1  # request being prefilled
        self.up = True
        self.epoch = 0  # bumped by a crash: events of the old life are ignored
        self.cache: PrefixCache = PrefixCache(self, cache_tokens, index)

    @property
    def depth(self) -> int:
        """queue_depth as the instance reports it: queued plus running."""
        return len(self.queue) + self.busy


class DecodeInstance:
    """Continuous batching: up to `max_batch` decode together; more wait (KV ready) in `waiting`.

    `held` counts every request routed here and not finished (waiting for KV, waiting for a batch
    slot, or decoding): the instance reports it as its queue depth, against `capacity`
    (decode_pool.max_concurrent_requests)."""

    __slots__ = ("idx", "name", "capacity", "max_batch", "held", "active", "waiting", "cache")

    def __init__(self, idx: int, name: str, capacity: int, max_batch: int, cache_tokens: int,
                 index: HolderIndex) -> None:
        self.idx, self.name, self.capacity, self.max_batch = idx, name, capacity, max_batch
        self.held = 0
        self.active = 0
        self.waiting: deque[int] = deque()
        self.cache: PrefixCache = PrefixCache(self, cache_tokens, index)
