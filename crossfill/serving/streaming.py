"""A streamed HTTP response that always closes its body when the client goes away.

Starlette's StreamingResponse stops sending when the client disconnects, but leaves the body
generator suspended wherever it was (at a `yield`, or cancelled inside an `await`) and lets the
garbage collector close it, maybe much later. Our bodies hold a stream to the next hop (decode,
prefill) whose closing is what tells that hop to abort its engine request and free its KV blocks,
so "later" means blocks held and tokens generated for nobody (seen: eight abandoned streams kept
decoding until the process stopped). Here the body is closed at once, and its cleanup runs
shielded from the cancellation that ended the response, so its own awaits can complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """StreamingResponse whose body generator is closed (shielded) as soon as the response ends."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def shielded(cleanup: Awaitable[Any]) -> None:
    """Await a cleanup step even while the surrounding task is being cancelled.

    Under anyio (which Starlette uses) cancellation is re-delivered at every await inside a
    cancelled scope, so an un-shielded `await stream.aclose()` in a `finally` is itself cancelled
    and the stream is left half-closed.
    """
    with anyio.CancelScope(shield=True):
        await cleanup


async def cancel_and_wait(*futures: asyncio.Future[Any] | None) -> None:
    """Cancel `futures` once and wait, shielded, until each has finished its own cleanup.

    Not `asyncio.gather`: a gather that is itself cancelled (as anyio re-cancels at every await)
    cancels its children a second time, which interrupts their cleanup half-way; an httpx stream
    cancelled twice marks itself closed but leaves its connection open, so the next hop never
    learns that the request is gone.
    """
    pending = [f for f in futures if f is not None and not f.done()]
    for f in pending:
        f.cancel()
    if pending:
        await shielded(asyncio.wait(pending))
    for f in futures:
        if f is not None and f.done() and not f.cancelled():
            f.exception()  # retrieved: an error of an abandoned step is not worth a warning
