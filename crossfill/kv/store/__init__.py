"""KV stores for store-and-pull transfer: opaque bytes under (tenant, key) with a TTL.

`KVStore` (base.py) is the interface; `EmbeddedStore` is the in-process default (memory + disk);
`MooncakeStore` (mooncake.py, needs the optional `mooncake` extra) talks to a Mooncake Store
cluster. `AsyncKVStore` wraps any of them for asyncio callers.
"""

from crossfill.kv.store.aio import AsyncKVStore
from crossfill.kv.store.base import (
    DEFAULT_TENANT,
    InvalidArgumentError,
    InvalidKeyError,
    KVStore,
    ObjectTooLargeError,
    StoreError,
    StoreStats,
    StoreUnavailableError,
)
from crossfill.kv.store.embedded import EmbeddedStore

__all__ = [
    "DEFAULT_TENANT",
    "AsyncKVStore",
    "EmbeddedStore",
    "InvalidArgumentError",
    "InvalidKeyError",
    "KVStore",
    "ObjectTooLargeError",
    "StoreError",
    "StoreStats",
    "StoreUnavailableError",
]
