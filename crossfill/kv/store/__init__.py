"""KV stores for store-and-pull transfer: opaque bytes under (tenant, key) with a TTL.

`KVStore` (base.py) is the interface, `WatchableKVStore` its optional change-notification
capability (the embedded store has it; Mooncake Store does not); `EmbeddedStore` is the
in-process default (memory + disk); `MooncakeStore` (`crossfill.kv.store.mooncake`, needs the
optional `mooncake` extra, so it is not imported here) talks to a Mooncake Store cluster whose
`mooncake_master` `MooncakeMaster` (`crossfill.kv.store.mooncake_master`) can start.
`AsyncKVStore` wraps any of them for asyncio.
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
    Watch,
    WatchableKVStore,
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
    "Watch",
    "WatchableKVStore",
]
