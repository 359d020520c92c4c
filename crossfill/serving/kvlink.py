"""How the workers use the KV transfer layer (crossfill.kv) with the settings of the config file.

One place maps `inference_service.kv_cache` and `.network` onto the transfer backend, so the
prefill side (sender) and the decode side (receiver) cannot disagree about codec or deadlines.
"""

from __future__ import annotations

from collections.abc import Sequence

from crossfill.config import CrossfillConfig
from crossfill.engine.types import LayerSpec
from crossfill.kv.codecs import resolve_compression
from crossfill.kv.tcp import KVReceiver, KVSender
from crossfill.kv.wire import Manifest


def connections_per_transfer(cfg: CrossfillConfig) -> int:
    # isolated_transport_queue: KV gets its own pool of parallel streams per transfer on the data
    # port, so one slow or broken stream neither blocks a layer nor shares a queue with others.
    return 4 if cfg.inference_service.network.isolated_transport_queue else 1


def make_sender(cfg: CrossfillConfig, host: str, port: int) -> KVSender:
    kv = cfg.inference_service.kv_cache
    return KVSender((host, port), connections=connections_per_transfer(cfg), timeout_ms=kv.timeout_ms,
                    max_retry=kv.max_retry)


def make_receiver(cfg: CrossfillConfig, host: str, port: int) -> KVReceiver:
    return KVReceiver(host, port, timeout_ms=cfg.inference_service.kv_cache.timeout_ms)


def import_namespace(cfg: CrossfillConfig, tenant: str) -> str:
    """Prefix-cache namespace of KV imported by decode.

    Imported blocks join the decode engine's prefix cache, where later colocated requests of the
    tenant may reuse them. KV that crossed the wire through a lossy codec (fp8, int8, bf16...) is
    not what the engine would compute itself, so it gets a namespace of its own: a colocated
    request never reuses approximated KV in place of exact KV.
    """
    kv = cfg.inference_service.kv_cache
    codec, _ = resolve_compression(kv.compression_enabled, kv.compression_mode, kv.codec)
    return tenant if codec.lossless else f"{tenant}#kv-codec={codec}"


def build_manifest(cfg: CrossfillConfig, *, cache_id: str, request_id: str, tenant: str, fingerprint: str,
                   token_ids: Sequence[int], layer_specs: Sequence[LayerSpec]) -> Manifest:
    """The manifest prefill announces: codec and window pruning from kv_cache.compression_*."""
    kv = cfg.inference_service.kv_cache
    codec, prune = resolve_compression(kv.compression_enabled, kv.compression_mode, kv.codec)
    # The manifest outlives the transfer's worst case (every retry timing out) by a margin.
    ttl_s = kv.timeout_ms / 1000 * (kv.max_retry + 2) + 30
    return Manifest.build(cache_id=cache_id, request_id=request_id, tenant=tenant, fingerprint=fingerprint,
                          token_ids=token_ids, layer_specs=layer_specs, codec=str(codec), prune_windows=prune,
                          ttl_s=ttl_s)
