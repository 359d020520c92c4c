"""KV cache events: the block hashes a worker's prefix cache stored and evicted, for the KV index.

The scheduler routes a request to the instance holding the longest cached prefix of its prompt
(crossfill.policy.kv_index). It learns what each worker holds from these events, as chain hashes
(crossfill.engine.block_pool.chain_hash, hex): never token ids or text.

Source: the block pool of the engine's *first full-attention layer group* — the group whose held
blocks 0..k decide a prefix hit of k blocks. Sliding-window groups are not tracked: a hit also
needs them to hold the window before block k, and they drop blocks on their own (their pool is
smaller), so for a hybrid model (Gemma 3) the index can claim a prefix the engine then reuses
only in part. The claim is a routing hint; the engine checks every hit itself. A model with
sliding groups only is tracked on its first group, and under-reports (old blocks leave a window).

Protocol (`KVEventLog.since`, served by the worker's `GET /v1/admin/stats?kv_events_since=N`):
events are numbered 1, 2, ...; an answer's `next` is the number to ask for next time. The answer
is a delta (`reset` false: `stored` then `evicted` net of everything in between, disjoint) when
the log still holds every event from N on, else a reset: `reset` true, `stored` = every hash
cached now, `evicted` empty. A reset comes when N <= 0 (first contact), N is past `next` or
older than the ring buffer, or `epoch` (random per log, so per engine life) is not the caller's.

Size of one answer: a delta carries at most `max_per_answer` events (20,000 by default); a
caller further behind gets the oldest of them and catches up over the next polls (or gets a
reset when the whole cache is smaller than its backlog). A reset is not paged: it is bounded by
the pool's block count, the most hashes the cache can hold (about 35 bytes of JSON each).

Cost on the engine's hot path: a lock and a deque append per stored or evicted block. The log
keeps its own set of the cached hashes, so a reset never walks the engine's pool from the HTTP
thread and never waits for an engine step.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

DEFAULT_CAPACITY = 65536  # events the ring buffer keeps (about 100 bytes each)
DEFAULT_MAX_PER_ANSWER = 20000


@dataclass(frozen=True)
class KVEventBatch:
    """One answer of `KVEventLog.since`; `as_dict` is its JSON shape on the wire."""

    epoch: str  # the log's random id: a new one means a new engine life (restart)
    next_seq: int  # what to ask for next time (0: nothing known yet, ask for a reset)
    reset: bool  # `stored` is the full set of cached hashes; forget what was known before
    stored: list[str]  # hex chain hashes
    evicted: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "next": self.next_seq, "reset": self.reset,
                "stored": self.stored, "evicted": self.evicted}

    @classmethod
    def nothing_yet(cls) -> KVEventBatch:
        """What a worker whose engine is not loaded answers: an empty cache, ask again from scratch."""
        return cls("", 0, True, [], [])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVEventBatch:
        """Parse the wire shape; a ValueError names the key that is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError(f"kv_events must be a JSON object, got {type(d).__name__}")
        epoch, nxt, reset = d.get("epoch"), d.get("next"), d.get("reset")
        if not isinstance(epoch, str):
            raise ValueError(f"kv_events.epoch must be a string, got {epoch!r}")
        if not isinstance(nxt, int) or isinstance(nxt, bool) or nxt < 0:
            raise ValueError(f"kv_events.next must be an integer >= 0, got {nxt!r}")
        if not isinstance(reset, bool):
            raise ValueError(f"kv_events.reset must be a boolean, got {reset!r}")
        lists = []
        for key in ("stored", "evicted"):
            value = d.get(key, [])
            if not isinstance(value, list) or not all(isinstance(h, str) for h in value):
                raise ValueError(f"kv_events.{key} must be a list of hex strings")
            lists.append(value)
        if reset and lists[1]:
            raise ValueError("kv_events.evicted must be empty in a reset (stored is the full set)")
        return cls(epoch, nxt, reset, lists[0], lists[1])


class KVEventLog:
    """Bounded, thread-safe log of stored/evicted block hashes; written by the engine thread only."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 max_per_answer: int = DEFAULT_MAX_PER_ANSWER) -> None:
        if capacity <= 0 or max_per_answer <= 0:
            raise ValueError(f"capacity ({capacity}) and max_per_answer ({max_per_answer}) must be > 0")
        self.epoch = secrets.token_hex(8)
        self.max_per_answer = max_per_answer
        self._lock = threading.Lock()
        self._ring: deque[tuple[bool, bytes]] = deque(maxlen=capacity)  # (stored?, hash), oldest first
        self._next = 1  # number of the next event; the ring holds [next - len(ring), next)
        self._cached: set[bytes] = set()

    # --- the engine's side ----------------------------------------------------------------------
    def stored(self, block_hash: bytes) -> None:
        with self._lock:
            self._ring.append((True, block_hash))
            self._cached.add(block_hash)
            self._next += 1

    def evicted(self, block_hash: bytes) -> None:
        with self._lock:
            self._ring.append((False, block_hash))
            self._cached.discard(block_hash)
            self._next += 1

    # --- the readers' side ------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def since(self, seq: int, epoch: str | None = None) -> KVEventBatch:
        """What changed from event `seq` on, or a reset (see the module docstring for when)."""
        with self._lock:
            nxt = self._next
            behind = nxt - seq
            oldest = nxt - len(self._ring)  # >= 1: events are numbered from 1
            too_far = behind > self.max_per_answer and len(self._cached) < behind  # a reset is smaller
            if (epoch is not None and epoch != self.epoch) or seq < oldest or seq > nxt or too_far:
                snapshot = list(self._cached)
                return KVEventBatch(self.epoch, nxt, True, [h.hex() for h in snapshot], [])
            # Walk from the newest end: a caller that keeps up asks for the last few events only.
            events = list(islice(reversed(self._ring), behind))
        events.reverse()
        events = events[: self.max_per_answer]
        last: dict[bytes, bool] = {}
        for is_store, block_hash in events:  # net effect: only each hash's last event counts
            last[block_hash] = is_store
        return KVEventBatch(
            self.epoch, seq + len(events), False,
            [h.hex() for h, s in last.items() if s], [h.hex() for h, s in last.items() if not s],
        )

    def seed(self, hashes: Iterable[bytes]) -> None:
        """Record hashes already cached before the log was attached (as stored events)."""
        for block_hash in hashes:
            self.stored(block_hash)
