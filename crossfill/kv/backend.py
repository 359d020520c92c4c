"""The transfer backend interface: how prefill ships KV and decode receives it, whatever the path.

Every backend (built-in TCP, store-and-pull, Mooncake Transfer Engine) implements the same two
halves so workers never care which one carries a transfer:

* sending:   `async with backend.open(manifest) as tx: await tx.send(chunk) ...; stats = await tx.commit()`
  `send` is called as each layer's KV appears, so transfer overlaps prefill. The backend keeps
  (pins) the encoded frames until the receiver acknowledges the commit, so any of them can be
  resent; with codec `none` a frame views the chunk's tensors rather than copying them, so the
  caller hands over tensors it no longer writes (the engine's exports are fresh copies).
* receiving: `await receiver.start()`, then per transfer `receiver.expect(Expectation(...))`
  before the KV can arrive (decode has reserved its blocks), then `await receiver.wait(cache_id)`,
  which returns the verified manifest once the commit is acknowledged or raises TransferError
  with a Reason; on error the consumer discards.  `transfer_bytes`, `counters`, `cancel`,
  `notify` and `address` mean the same on every receiver.

Workers build both halves with `crossfill.kv.transports` (by transport name) and are typed against
these two classes only, never a backend class.

Leaving the `open()` block without `commit()` aborts the transfer on both sides.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from typing import Self

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Expectation
from crossfill.kv.wire import Manifest


@dataclass
class TransferStats:
    """What one completed transfer cost."""

    cache_id: str
    frames: int
    raw_bytes: int  # K and V in their original dtype, after window pruning
    wire_bytes: int  # encoded payload bytes (excluding framing)
    retransmits: int
    reconnects: int
    duration_s: float  # open() to commit acknowledged
    commit_wait_s: float  # last send() returned to commit acknowledged: the tail pipelining hides the rest of
    streams: int = 1  # parallel streams the transfer opened

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    @property
    def goodput_bytes_per_s(self) -> float:
        return self.wire_bytes / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


class OutgoingTransfer(abc.ABC):
    """One transfer in progress on the sending side."""

    committed: bool = False  # set by commit() once the receiver acknowledged it

    @abc.abstractmethod
    async def send(self, chunk: LayerKVChunk) -> None:
        """Queue one layer's KV for [chunk.start, chunk.end); returns once it is encoded and queued.

        Tokens outside the manifest's range for that layer (pruned window, skipped prefix) are
        dropped here; chunks of one layer must arrive in token order.
        """

    @abc.abstractmethod
    async def commit(self) -> TransferStats:
        """Wait until every frame is acknowledged, then the commit; raises TransferError on failure."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None:
        """Give up: tell the receiver (best effort) and release the pinned KV."""


@contextlib.asynccontextmanager
async def aborted_unless_committed(tx: OutgoingTransfer) -> AsyncIterator[OutgoingTransfer]:
    """The body of every backend's `open()`: yields `tx`, aborts it (both sides) if the caller
    raises or leaves the block without `commit()`."""
    try:
        yield tx
    except BaseException as exc:
        await tx.abort(f"sender raised {type(exc).__name__}: {exc}")
        raise
    finally:
        if not tx.committed:
            await tx.abort("transfer left without commit()")


class TransferBackend(abc.ABC):
    """Sending half of a backend: one per destination (endpoint, store, engine)."""

    name: str = "abstract"

    @abc.abstractmethod
    def open(self, manifest: Manifest) -> AbstractAsyncContextManager[OutgoingTransfer]:
        """Start a transfer described by `manifest`."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections or clients held between transfers."""


class ReceiveBackend(abc.ABC):
    """Receiving half of a backend, used by the decode worker; every receiver answers all of it.

    Lifecycle: `await start()` (binds a server where the backend has one) ... `await close()`, or
    `async with receiver:`.  Per transfer: `expect(Expectation)` before the KV can arrive, then
    `await wait(cache_id)`; `transfer_bytes(cache_id)` stays answerable after `wait()` returned.
    """

    name: str = "abstract"

    async def start(self) -> Self:
        """Start serving (no-op where there is nothing to start); returns self."""
        return self

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop serving; transfers still expected fail with `aborted`."""

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where senders reach this receiver: host:port, or a description of the store it pulls from."""

    @abc.abstractmethod
    def expect(self, expectation: Expectation) -> None:
        """Register a transfer decode is ready for (call from the event loop); frames for
        unregistered cache ids are refused.  A cache id already expected is a ValueError.  An
        Expectation without `timeout_s` gets the receiver's `timeout_ms`."""

    @abc.abstractmethod
    async def wait(self, cache_id: str) -> Manifest:
        """Return the manifest once the commit verified; raise TransferError (discard the KV) otherwise."""

    @abc.abstractmethod
    def cancel(self, cache_id: str, reason: str = "cancelled by decode") -> None:
        """Stop expecting a transfer (request aborted); later frames for it are refused."""

    @abc.abstractmethod
    def counters(self) -> dict[str, int]:
        """Accepted / refused counts by reason, for metrics and troubleshooting."""

    @abc.abstractmethod
    def transfer_bytes(self, cache_id: str) -> tuple[int, int]:
        """(raw, wire) payload bytes accepted for a current or recently finished transfer; (0, 0) if unknown."""

    def keep_alive(self, cache_id: str) -> bool:
        """The sender is alive and still computing `cache_id` (its prefill is queued or running):
        restart the silence timer. True when the receiver acted on it."""
        return False

    def notify(self, cache_id: str) -> bool:
        """Hint that the sender committed `cache_id` (e.g. from the control channel); True when
        the receiver acted on it.  Only receivers that poll need it; the default ignores it."""
        return False
