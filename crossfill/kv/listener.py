"""A TCP (optionally TLS) listener that keeps its connection handlers, so closing it ends them all.

Both data-plane servers, the control server of the TCP and TE backends and the store server, accept
connections and run one handler task per connection; this is that bookkeeping, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Iterator


class Listener:
    """Where a server listens, its asyncio server once started, and its live connection handlers."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        self.host = host
        self.requested_port = port
        self.tls = tls
        self.server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start_protocol(self, factory: Callable[[], asyncio.BaseProtocol]) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(factory, self.host, self.requested_port, ssl=self.tls)

    async def start_streams(self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                                    Awaitable[None]]) -> None:
        self.server = await asyncio.start_server(handler, self.host, self.requested_port, ssl=self.tls)

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Run the body as a connection handler that close() cancels."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            yield
        finally:
            self._handlers.discard(task)

    async def close(self) -> None:
        if self.server is None:
            return
        self.server.close()
        for t in list(self._handlers):
            t.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self.server.wait_closed()
        self.server = None

    @property
    def port(self) -> int:
        assert self.server is not None, "call start() first"
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Listens:
    """Mixin of a server that owns a `listener`: where clients reach it."""

    listener: Listener

    @property
    def port(self) -> int:
        return self.listener.port

    @property
    def address(self) -> str:
        return self.listener.address
