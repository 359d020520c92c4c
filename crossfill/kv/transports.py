"""Build a transfer backend by transport name, so the serving layer never imports a backend class.

Workers are typed against `TransferBackend` / `ReceiveBackend` (backend.py) and get them here from
plain arguments (what the config says): `make_sender` on the prefill side, one per decode
endpoint; `make_receiver` on the decode side, on its KV port.

    transport     sender (prefill)                          receiver (decode)
    tcp           KVSender -> endpoint                      KVReceiver on host:port
    mooncake_te   TESender -> endpoint, bytes by `te`       TEReceiver on host:port, region in `te`
    store         StorePushSender -> `store`, or a          StorePullReceiver on `store`; an embedded
                  RemoteStore at endpoint when none given   store is also served on host:port

What a worker process holds between transfers (the TE engine, the store or its cluster client) is
made by `open_shared` from the config's words and passed to the factories as `shared=`
(`close_shared` releases it); `check_available` says before start-up, naming what to install,
when a transport cannot load here.

So for the store transport with an embedded store, decode's KV port serves its store
(StoreServer) and prefill pushes to it over the network; with Mooncake Store both sides pass
their client of the cluster and nothing is served.  `tls` (crossfill.kv.tls contexts: client on
the sender, server on the receiver) turns on mutual TLS where the transport has a TCP stream to
protect: TCP streams and the store server.  The TE backend's bytes travel outside TLS, so
`mooncake_te` with `tls` is refused rather than silently unencrypted.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TYPE_CHECKING, Any, Literal, get_args

from crossfill.kv.backend import ReceiveBackend, TransferBackend
from crossfill.kv.store.base import KVStore
from crossfill.kv.store.embedded import EmbeddedStore
from crossfill.kv.store.remote import RemoteStore, StoreServer
from crossfill.kv.storepull import StorePullReceiver, StorePushSender
from crossfill.kv.tcp import KVReceiver, KVSender
from crossfill.kv.te_backend import TEReceiver, TESender
from crossfill.security.kv_crypto import AtRest

if TYPE_CHECKING:
    from crossfill.kv.mooncake_te import MooncakeTransferEngine

Transport = Literal["tcp", "mooncake_te", "store"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
STORES = ("embedded", "mooncake")
# How often a worker's store removes (and wipes) expired KV that nobody reads again; without it an
# expired object would wait for the next put (M5.9: secure deletion of expired caches).
SWEEP_INTERVAL_S = 5.0


def check_transport(transport: str) -> Transport:
    """The transport name, or a ValueError naming the valid ones."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {transport!r}: use one of {', '.join(TRANSPORTS)}")
    return transport  # type: ignore[return-value]


def _te_without_tls(te: MooncakeTransferEngine | None, tls: ssl.SSLContext | None) -> MooncakeTransferEngine:
    if te is None:
        raise ValueError("transport 'mooncake_te' needs a Mooncake Transfer Engine (te=make_te_engine(...))")
    if tls is not None:
        raise ValueError("transport 'mooncake_te' cannot use TLS: its bytes move outside any TLS stream; "
                         "use 'tcp' or 'store' for an encrypted data plane")
    return te


def _split_shared(shared: Any, store: KVStore | None, te: MooncakeTransferEngine | None
                  ) -> tuple[KVStore | None, MooncakeTransferEngine | None]:
    """`shared` (what open_shared returned) is the TE engine or the store; explicit arguments win."""
    if shared is None:
        return store, te
    if hasattr(shared, "submit_write"):  # a MooncakeTransferEngine
        return store, te if te is not None else shared
    return store if store is not None else shared, te


def make_sender(transport: str, *, endpoint: tuple[str, int] | str, tls: ssl.SSLContext | None = None,
                connections: int = 4, timeout_ms: int = 8000, max_retry: int = 2, store: KVStore | None = None,
                te: MooncakeTransferEngine | None = None, shared: Any = None,
                at_rest: AtRest | None = None) -> TransferBackend:
    """The sending half for one decode endpoint (its KV port, or its store server for 'store').

    `shared`: what `open_shared` returned for this process (the TE engine or the store), instead of
    passing `te` / `store`. `at_rest`: how 'store' seals what it writes (None: stored as is).
    """
    kind = check_transport(transport)
    store, te = _split_shared(shared, store, te)
    if kind == "tcp":
        return KVSender(endpoint, tls=tls, connections=connections, timeout_ms=timeout_ms, max_retry=max_retry)
    if kind == "mooncake_te":
        return TESender(endpoint, _te_without_tls(te, tls), timeout_ms=timeout_ms, max_retry=max_retry)
    if store is not None:
        return StorePushSender(store, timeout_ms=timeout_ms, max_retry=max_retry, at_rest=at_rest)
    remote = RemoteStore(endpoint, tls=tls, timeout_s=timeout_ms / 1000, pool_size=max(4, connections))
    return StorePushSender(remote, timeout_ms=timeout_ms, max_retry=max_retry, owns_store=True, at_rest=at_rest)


def make_receiver(transport: str, *, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None,
                  timeout_ms: int = 8000, store: KVStore | None = None,
                  te: MooncakeTransferEngine | None = None, shared: Any = None,
                  at_rest: AtRest | None = None) -> ReceiveBackend:
    """The receiving half on decode's KV port (host, port); call `await receiver.start()` next.

    `at_rest`: how 'store' opens what it reads; it must match the senders' (same cipher on or off).
    """
    kind = check_transport(transport)
    store, te = _split_shared(shared, store, te)
    if kind == "tcp":
        return KVReceiver(host, port, tls=tls, timeout_ms=timeout_ms)
    if kind == "mooncake_te":
        return TEReceiver(_te_without_tls(te, tls), host, port, timeout_ms=timeout_ms)
    if store is None:
        raise ValueError("transport 'store' needs the store decode pulls from (an EmbeddedStore or a MooncakeStore)")
    server = StoreServer(store, host, port, tls=tls) if isinstance(store, EmbeddedStore) else None
    return StorePullReceiver(store, timeout_ms=timeout_ms, server=server, at_rest=at_rest)


def make_te_engine(hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
                   protocol: str = "tcp") -> MooncakeTransferEngine:
    """One Mooncake Transfer Engine for this process (share it between sender and receiver).

    Raises MooncakeUnavailableError saying what to install when the Mooncake wheel or libibverbs
    is missing, and MooncakeTEError when the engine does not start.
    """
    try:
        from crossfill.kv.mooncake_te import MooncakeTransferEngine, MooncakeUnavailableError
    except ImportError as exc:  # numpy or the wrapper itself: say so in the same terms
        raise RuntimeError(f"the Mooncake TE wrapper cannot be imported: {exc}") from exc
    try:
        return MooncakeTransferEngine(hostname, metadata_server, protocol)
    except OSError as exc:  # the wheel imports but its shared libraries (libibverbs) do not load
        raise MooncakeUnavailableError(f"Mooncake Transfer Engine cannot load ({exc}): install the OS package "
                                       "libibverbs1 (needed even for the TCP transport)") from exc


def check_available(transport: str, store: str | None = None) -> None:
    """Raise (saying what to install) when `transport` (with `store`) cannot load in this process."""
    kind = check_transport(transport)
    if kind == "store" and store is not None and store not in STORES:
        raise ValueError(f"unknown KV store {store!r}: use one of {', '.join(STORES)}")
    if kind == "mooncake_te":
        from crossfill.kv.mooncake_te import _import_engine

        _import_engine()  # MooncakeUnavailableError names the wheel and libibverbs1
    if kind == "store" and store == "mooncake":
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            from crossfill.kv.store.base import StoreUnavailableError

            raise StoreUnavailableError(f"Mooncake Store needs the optional 'mooncake' extra ({exc}): pip install "
                                        "'crossfill[mooncake]' and the OS package libibverbs1") from exc


async def open_shared(transport: str, *, store: str | None = None, mooncake_master: str | None = None,
                      segment_mb: int = 1024, role: Literal["prefill", "decode"] = "decode",
                      disk_dir: str | None = None, disk_mb: int = 4096, hostname: str = "127.0.0.1") -> Any:
    """What a worker process holds for its transport between transfers; pass it as `shared=`.

    tcp: nothing (None).  mooncake_te: one Mooncake Transfer Engine.  store + mooncake: a Mooncake
    Store client of `mooncake_master`, giving `segment_mb` to the cluster.  store + embedded: on
    decode, its EmbeddedStore (`segment_mb` of memory, a `disk_mb` disk tier under `disk_dir`),
    which `make_receiver` serves on the KV port; on prefill nothing (it reaches decode's store
    server).  Close it with `close_shared`.
    """
    kind = check_transport(transport)
    if kind == "mooncake_te":
        return await asyncio.to_thread(make_te_engine, hostname)
    if kind == "tcp":
        return None
    if store == "mooncake":
        if mooncake_master is None:
            raise ValueError("store 'mooncake' needs mooncake_master (host:port)")
        from crossfill.kv.store.mooncake import MooncakeStore

        return await asyncio.to_thread(MooncakeStore, mooncake_master, local_hostname=hostname,
                                       global_segment_bytes=segment_mb << 20, sweep_interval_s=SWEEP_INTERVAL_S)
    if store not in (None, "embedded"):
        raise ValueError(f"unknown KV store {store!r}: use one of {', '.join(STORES)}")
    if role == "prefill":
        return None
    return EmbeddedStore(memory_capacity_bytes=segment_mb << 20, disk_dir=disk_dir,
                         disk_capacity_bytes=(disk_mb << 20) if disk_dir else 0, sweep_interval_s=SWEEP_INTERVAL_S)


async def close_shared(shared: Any) -> None:
    """Release what `open_shared` returned (None is fine)."""
    if shared is not None:
        await asyncio.to_thread(shared.close)


__all__ = ["STORES", "TRANSPORTS", "Transport", "check_available", "check_transport", "close_shared",
           "make_receiver", "make_sender", "make_te_engine", "open_shared"]
