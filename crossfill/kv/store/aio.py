"""An asyncio face for any `KVStore`.

Stores are synchronous and thread-safe (see base.py); this adapter runs each call in the default
thread pool so an event loop (the transfer backends, the decode worker) never blocks on disk or on
Mooncake's client.
"""

from __future__ import annotations

import asyncio

from crossfill.kv.store.base import DEFAULT_TENANT, KVStore, StoreStats


class AsyncKVStore:
    """Awaitable wrapper: `await AsyncKVStore(store).put(...)` etc., same semantics as `store`."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    async def put(
        self, key: str, data: bytes, ttl_s: float | None = None, tenant: str = DEFAULT_TENANT
    ) -> None:
        await asyncio.to_thread(self.store.put, key, data, ttl_s, tenant)

    async def get(self, key: str, tenant: str = DEFAULT_TENANT) -> bytes | None:
        return await asyncio.to_thread(self.store.get, key, tenant)

    async def delete(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        return await asyncio.to_thread(self.store.delete, key, tenant)

    async def exists(self, key: str, tenant: str = DEFAULT_TENANT) -> bool:
        return await asyncio.to_thread(self.store.exists, key, tenant)

    async def stats(self) -> StoreStats:
        return await asyncio.to_thread(self.store.stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.store.close)
