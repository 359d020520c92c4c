"""Helpers for the KV transfer tests: synthetic layer specs and KV, a recording sink, TLS material."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.assembler import Expectation, Sink
from crossfill.kv.store.base import KVStore
from crossfill.kv.store.remote import StoreServer
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


def expectation(cache_id: str, sink: Sink, *, timeout_ms: int | None = None, **kw: object) -> Expectation:
    """An Expectation with the silence bound in milliseconds, as the tests write it."""
    return Expectation(cache_id, sink, timeout_s=None if timeout_ms is None else timeout_ms / 1000,
                       **kw)  # type: ignore[arg-type]


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


class FlipProxy:
    """Loopback TCP proxy that flips one bit at byte `flip_at` of the first client->server stream.

    Deterministic corruption of a chosen byte (e.g. inside a frame's payload), which a shaping
    emulator that corrupts "the next bytes" cannot aim at.
    """

    def __init__(self, upstream_port: int, flip_at: int) -> None:
        self.upstream_port = upstream_port
        self.flip_at = flip_at
        self.flipped = False
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._first = True

    async def __aenter__(self) -> FlipProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        flip = self._first
        self._first = False
        for coro in (self._pump(reader, up_writer, flip), self._pump(up_reader, writer, False)):
            t = asyncio.create_task(coro)
            self._tasks.add(t)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flip: bool) -> None:
        offset = 0
        try:
            while data := await reader.read(65536):
                if flip and not self.flipped and offset <= self.flip_at < offset + len(data):
                    buf = bytearray(data)
                    buf[self.flip_at - offset] ^= 0x01
                    data = bytes(buf)
                    self.flipped = True
                offset += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


@contextlib.contextmanager
def served_store(store: KVStore, **kw: object) -> Iterator[str]:
    """Serve `store` with a StoreServer on its own event loop in a thread (as another process
    would), so a test may call a RemoteStore synchronously from its own loop; yields the address."""
    loop = asyncio.new_event_loop()
    server = StoreServer(store, **kw)  # type: ignore[arg-type]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
        yield server.address
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
