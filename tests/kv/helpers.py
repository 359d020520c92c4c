"""Helpers for the KV transfer tests: synthetic layer specs and KV, a recording sink, TLS material."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.wire import Manifest

FINGERPRINT = "f" * 64


def hybrid_specs(n: int = 6, heads: int = 2, dim: int = 16, window: int = 32,
                 dtype: torch.dtype = torch.float32) -> list[LayerSpec]:
    """Gemma-3-like: every third layer full attention, the others sliding-window."""
    return [LayerSpec(i, "full" if i % 3 == 2 else "sliding", None if i % 3 == 2 else window, heads, dim, dtype)
            for i in range(n)]


def make_kv(specs: list[LayerSpec], tokens: int, seed: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {s.index: (torch.randn(tokens, s.num_kv_heads, s.head_dim, generator=g).to(s.dtype),
                      torch.randn(tokens, s.num_kv_heads, s.head_dim, generator=g).to(s.dtype)) for s in specs}


def build_manifest(specs: list[LayerSpec], tokens: int, cache_id: str = "cache-1", codec: str = "none",
                   prune: bool = True, frame_tokens: int = 16, ttl_s: float = 60.0) -> Manifest:
    return Manifest.build(cache_id=cache_id, request_id="req-1", tenant="tenant-a", fingerprint=FINGERPRINT,
                          token_ids=list(range(tokens)), layer_specs=specs, codec=codec, prune_windows=prune,
                          frame_tokens=frame_tokens, ttl_s=ttl_s)


class Collector:
    """A sink that records what the decode side would import, keyed by (layer, start)."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[int, int], LayerKVChunk] = {}
        self.calls = 0

    def __call__(self, chunk: LayerKVChunk) -> None:
        self.calls += 1
        self.chunks[(chunk.layer, chunk.start)] = chunk

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = sorted((c for (layer, _), c in self.chunks.items() if layer == index), key=lambda c: c.start)
        return torch.cat([c.k for c in parts]), torch.cat([c.v for c in parts])


def assert_identical(manifest: Manifest, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], sink: Collector) -> None:
    """Every shipped token of every layer arrived bit-identical."""
    for e in manifest.layers:
        k, v = sink.layer(e.index)
        assert torch.equal(k, kv[e.index][0][e.start:e.end]), f"layer {e.index} K differs"
        assert torch.equal(v, kv[e.index][1][e.start:e.end]), f"layer {e.index} V differs"


@dataclass
class TLSFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # signed by a different CA
    rogue_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, ca: bool = False,
          ip: str | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ip:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_tls_files(d: Path) -> TLSFiles:
    out: dict[str, Path] = {}

    def write(name: str, data: bytes) -> Path:
        out[name] = d / name
        out[name].write_bytes(data)
        return out[name]

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crossfill test CA")])
    ca = _cert("crossfill test CA", ca_key, ca_name, ca_key, ca=True)
    write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    for who, ip in (("server", "127.0.0.1"), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(f"{who}.pem", _cert(who, key, ca_name, ca_key, ip=ip).public_bytes(serialization.Encoding.PEM))
        write(f"{who}.key", _key_pem(key))
    rogue_ca_key = ec.generate_private_key(ec.SECP256R1())
    rogue_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rogue CA")])
    rkey = ec.generate_private_key(ec.SECP256R1())
    write("rogue.pem", _cert("rogue", rkey, rogue_name, rogue_ca_key).public_bytes(serialization.Encoding.PEM))
    write("rogue.key", _key_pem(rkey))
    return TLSFiles(out["ca.pem"], out["server.pem"], out["server.key"], out["client.pem"], out["client.key"],
                    out["rogue.pem"], out["rogue.key"])
