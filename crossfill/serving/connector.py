"""The KV connector seam: how a worker role uses KV transport, whatever `kv_cache.transport` names.

Modelled on vLLM's KVConnectorBase_V1 + KVConnectorFactory: one connector per worker role, built
from the config; workers call only the connector, and the connector only the interfaces of
crossfill.kv.backend (`TransferBackend`, `ReceiveBackend`), built by crossfill.kv.transports. No
serving module imports a backend class.

Prefill side (`PrefillConnector`):
  * `plan(job)`      -> where the export starts: after the prefix decode says it holds, when the
                        claim checks out (in range, digest of those tokens matches); else 0, with
                        the reason (counted by the worker) — a bad claim costs bytes, never output.
  * `open(job, ...)` -> an `OutgoingTransfer` to the decode instance: `send(chunk)` per layer as
                        prefill computes it, `commit()` for the stats.
Decode side (`DecodeConnector`):
  * `reserve(...)`   -> the engine import with only the blocks decode does not already hold.
  * `expect(...)`    -> register the transfer (verified by crossfill.kv.assembler) before prefill runs.
  * `wait / cancel / notify / transfer_bytes / counters` -> the receiver's uniform interface.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossfill.config import ConfigError, CrossfillConfig, Instance
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import LayerSpec
from crossfill.kv import tls as kv_tls
from crossfill.kv import transports
from crossfill.kv.assembler import Expectation
from crossfill.kv.backend import OutgoingTransfer, ReceiveBackend, TransferBackend
from crossfill.kv.codecs import resolve_compression
from crossfill.kv.wire import Manifest, token_digest
from crossfill.security import tls_http
from crossfill.security.kv_crypto import AtRest, load_cipher
from crossfill.serving.protocol import PrefillJob

log = logging.getLogger("crossfill.connector")


# --------------------------------------------------------------------------- shared settings


def connections_per_transfer(cfg: CrossfillConfig) -> int:
    # isolated_transport_queue: KV gets its own pool of parallel streams per transfer on the data
    # port, so one slow or broken stream neither blocks a layer nor shares a queue with others.
    return 4 if cfg.inference_service.network.isolated_transport_queue else 1


def import_namespace(cfg: CrossfillConfig, tenant: str) -> str:
    """Prefix-cache namespace of KV imported by decode.

    Imported blocks join the decode engine's prefix cache, where later requests of the tenant may
    reuse them (colocated, or as the decode-held prefix of a later import). KV that crossed the
    wire through a lossy codec (fp8, int8, bf16...) is not what the engine would compute itself,
    so it gets a namespace of its own: a colocated request never reuses approximated KV as exact.
    """
    kv = cfg.inference_service.kv_cache
    codec, _ = resolve_compression(kv.compression_enabled, kv.compression_mode, kv.codec)
    return tenant if codec.lossless else f"{tenant}#kv-codec={codec}"


def tls_contexts(cfg: CrossfillConfig, service: str) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) contexts for mutual TLS on the data plane, as instance `service`.

    An explicit kv_cache.tls names its own files; otherwise, with security.tls.enabled, the
    instance's certificate from security.dir (the one its HTTP port presents). (None, None): off.
    """
    t = cfg.inference_service.kv_cache.tls
    if t is None:
        kv = cfg.inference_service.kv_cache
        if not cfg.security.tls.enabled:
            return None, None
        if kv.transport == "mooncake_te" or (kv.transport == "store" and kv.store == "mooncake"):
            # Mooncake moves the bytes over its own transport, outside any stream crossfill could
            # wrap; the HTTP hops stay under mutual TLS and stored KV is encrypted at rest.
            log.warning("security.tls: KV bytes cross in Mooncake's own plaintext transport (transport %s%s); "
                        "only the HTTP hops are under mutual TLS", kv.transport,
                        f", store {kv.store}" if kv.transport == "store" else "")
            return None, None
        return tls_http.server_context(cfg, service), tls_http.client_context(cfg, service)
    cert, key, ca = (Path(p).expanduser() for p in (t.cert_file, t.key_file, t.ca_file))
    try:
        return kv_tls.server_context(cert, key, ca), kv_tls.client_context(ca, cert, key)
    except kv_tls.TLSConfigError as exc:
        raise ConfigError(f"inference_service.kv_cache.tls: {exc}") from None


def preflight(cfg: CrossfillConfig) -> None:
    """Refuse to start (ConfigError naming the key) when the configured transport cannot work here.

    Runs before the worker serves anything, so `crossfill up` stops with the reason instead of
    waiting for a worker that can never become ready.
    """
    kv = cfg.inference_service.kv_cache
    if kv.transport == "store" and kv.store == "mooncake" and kv.mooncake_master:
        host, _, port = kv.mooncake_master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=3.0).close()
        except OSError as exc:
            raise ConfigError(f"inference_service.kv_cache.mooncake_master: nothing answers at {kv.mooncake_master} "
                              f"({exc.strerror or exc}); start mooncake_master there or set "
                              "start_mooncake_master: true for `crossfill up`") from None
    try:
        transports.check_available(kv.transport, kv.store)
    except Exception as exc:  # noqa: BLE001 - any reason the transport cannot load becomes a config error
        raise ConfigError(f"inference_service.kv_cache.transport: {kv.transport!r} cannot be used here: {exc}") from None


def kv_at_rest(cfg: CrossfillConfig, **reporting: Any) -> AtRest:
    """How the store transport seals KV (security.kv_encryption); `reporting`: registry=, audit=.

    The master key is read only where KV lands in a store, and at start-up, so a missing key file
    stops the worker (ConfigError naming security.dir) instead of failing every transfer.
    """
    store = cfg.inference_service.kv_cache.transport == "store"
    return AtRest(load_cipher(cfg) if store else None, **reporting)


def build_manifest(cfg: CrossfillConfig, *, cache_id: str, request_id: str, tenant: str, fingerprint: str,
                   token_ids: list[int], layer_specs: list[LayerSpec], skip_tokens: int = 0,
                   ticket: str | None = None) -> Manifest:
    """The manifest prefill announces: codec and window pruning from kv_cache.compression_*, and the
    route's transfer ticket, which decode checks before accepting anything."""
    kv = cfg.inference_service.kv_cache
    codec, prune = resolve_compression(kv.compression_enabled, kv.compression_mode, kv.codec)
    # The manifest outlives the transfer's worst case (every retry timing out) by a margin.
    ttl_s = kv.timeout_ms / 1000 * (kv.max_retry + 2) + 30
    return Manifest.build(cache_id=cache_id, request_id=request_id, tenant=tenant, fingerprint=fingerprint,
                          token_ids=token_ids, layer_specs=layer_specs, codec=str(codec), prune_windows=prune,
                          skip_tokens=skip_tokens, ttl_s=ttl_s, ticket=ticket)


def skipped_raw_bytes(layer_specs: list[LayerSpec], cfg: CrossfillConfig, num_tokens: int, skip: int) -> int:
    """KV bytes (before the codec) that a skipped prefix of `skip` tokens would have put on the wire."""
    kv = cfg.inference_service.kv_cache
    _, prune = resolve_compression(kv.compression_enabled, kv.compression_mode, kv.codec)
    total = 0
    for spec in layer_specs:
        start = num_tokens - spec.kept_tokens(num_tokens) if prune else 0
        total += max(0, min(skip, num_tokens) - start) * spec.bytes_per_token
    return total


# --------------------------------------------------------------------------- prefill side


@dataclass(frozen=True)
class ExportPlan:
    export_from: int  # first prompt token whose KV is sent
    refused: str | None = None  # why decode's claim was not used (None: used, or there was none)


class PrefillConnector:
    """Prefill side of the seam: one sender per decode endpoint, opened per transfer."""

    def __init__(self, cfg: CrossfillConfig, inst: Instance, at_rest: AtRest | None = None) -> None:
        self.cfg = cfg
        self.inst = inst
        self.transport = cfg.inference_service.kv_cache.transport
        self.at_rest = at_rest or kv_at_rest(cfg)
        self._senders: dict[tuple[str, int], TransferBackend] = {}
        self._shared: Any = None  # the TE engine or Mooncake Store client, when the transport has one
        preflight(cfg)
        _, self._tls = tls_contexts(cfg, inst.name)

    async def start(self) -> None:
        """Connect what the transport needs before the worker reports ready (fails naming the key)."""
        self._shared = await transports.open_shared(self.transport, **self._shared_args(self.cfg, self.inst))

    async def close(self) -> None:
        for sender in self._senders.values():
            await sender.close()
        self._senders.clear()
        await transports.close_shared(self._shared)

    @staticmethod
    def _shared_args(cfg: CrossfillConfig, inst: Instance) -> dict[str, Any]:
        kv = cfg.inference_service.kv_cache
        # Mooncake peers reach this process at its instance host (the config's address for it).
        return {"store": kv.store if kv.transport == "store" else None, "mooncake_master": kv.mooncake_master,
                "segment_mb": kv.store_memory_mb, "role": "prefill", "hostname": inst.host}

    def plan(self, job: PrefillJob) -> ExportPlan:
        claimed = job.decode_cached_tokens
        if claimed == 0:
            return ExportPlan(0)
        n = len(job.prompt_token_ids)
        if claimed >= n:
            return ExportPlan(0, f"claim_out_of_range: decode claims {claimed} cached tokens of a {n}-token prompt")
        if job.decode_prefix_digest != token_digest(job.prompt_token_ids[:claimed]):
            return ExportPlan(0, f"digest_mismatch: the digest of the first {claimed} prompt tokens differs")
        return ExportPlan(claimed)

    def open(self, job: PrefillJob, manifest: Manifest) -> AbstractAsyncContextManager[OutgoingTransfer]:
        key = (job.kv_host, job.kv_port)
        sender = self._senders.get(key)
        if sender is None:
            kv = self.cfg.inference_service.kv_cache
            sender = transports.make_sender(
                self.transport, endpoint=key, tls=self._tls, connections=connections_per_transfer(self.cfg),
                timeout_ms=kv.timeout_ms, max_retry=kv.max_retry, shared=self._shared, at_rest=self.at_rest)
            self._senders[key] = sender
        return sender.open(manifest)


# --------------------------------------------------------------------------- decode side


@dataclass
class Reservation:
    """An engine import waiting for its KV: the handle, and the prefix decode already held."""

    handle: Any  # crossfill.engine.async_engine.KVImportHandle
    cache_id: str
    cached_tokens: int
    prefix_digest: str | None


class DecodeConnector:
    """Decode side of the seam: one receiver on this instance's KV port, for every transfer."""

    def __init__(self, cfg: CrossfillConfig, inst: Instance, at_rest: AtRest | None = None) -> None:
        self.cfg = cfg
        self.inst = inst
        self.transport = cfg.inference_service.kv_cache.transport
        self.at_rest = at_rest or kv_at_rest(cfg)
        self.receiver: ReceiveBackend | None = None
        self._shared: Any = None
        preflight(cfg)
        self._tls, _ = tls_contexts(cfg, inst.name)

    async def start(self) -> None:
        assert self.inst.kv_port is not None
        kv = self.cfg.inference_service.kv_cache
        self._shared = await transports.open_shared(self.transport, **{
            **PrefillConnector._shared_args(self.cfg, self.inst), "role": "decode",
            "disk_dir": kv.store_disk_dir, "disk_mb": kv.store_disk_mb})
        self.receiver = await transports.make_receiver(
            self.transport, host=self.inst.host, port=self.inst.kv_port, tls=self._tls,
            timeout_ms=kv.timeout_ms, shared=self._shared, at_rest=self.at_rest).start()

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        await transports.close_shared(self._shared)

    def _rx(self) -> ReceiveBackend:
        if self.receiver is None:
            raise RuntimeError("the decode connector is not started")
        return self.receiver

    async def reserve(self, engine: Any, cache_id: str, prompt: list[int], params: SamplingParams,
                      tenant: str) -> Reservation:
        """Import `prompt` into the engine, reusing the prefix it holds; NoKVCapacityError when full."""
        handle = await engine.import_kv(cache_id, prompt, params, namespace=import_namespace(self.cfg, tenant),
                                        reuse_prefix=self.cfg.inference_service.kv_cache.reuse_decode_prefix)
        cached = handle.cached_tokens
        return Reservation(handle, cache_id, cached, token_digest(prompt[:cached]) if cached else None)

    def expect(self, res: Reservation, *, fingerprint: str, prompt: list[int], tenant: str,
               authorize: Callable[[Manifest], None] | None = None) -> None:
        """Register the transfer; `authorize` (the transfer-ticket check) sees its manifest first."""
        kv = self.cfg.inference_service.kv_cache
        checks: dict[str, Any] = {}
        if kv.checksum_enabled:
            checks = {"fingerprint": fingerprint, "token_digest": token_digest(prompt)}
        self._rx().expect(Expectation(cache_id=res.cache_id, sink=res.handle.write, tenant=tenant,
                                      timeout_s=kv.timeout_ms / 1000, authorize=authorize, **checks))

    async def wait(self, cache_id: str) -> Manifest:
        return await self._rx().wait(cache_id)

    def notify(self, cache_id: str) -> None:
        """The sender says it committed: a store puller may look now instead of at its next poll."""
        self._rx().notify(cache_id)

    def keep_alive(self, cache_id: str) -> None:
        """Prefill reported in (accepted, heartbeat) before its first token: its KV is not late yet."""
        self._rx().keep_alive(cache_id)

    def cancel(self, cache_id: str, reason: str) -> None:
        self._rx().cancel(cache_id, reason)

    def transfer_bytes(self, cache_id: str) -> tuple[int, int]:
        return self._rx().transfer_bytes(cache_id)

    def counters(self) -> dict[str, int]:
        return self._rx().counters() if self.receiver is not None else {}
