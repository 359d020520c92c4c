"""What mutual TLS costs crossfill, plaintext and TLS side by side in the same run.

    .venv/bin/python bench/tls.py [--runs 5] [--kv-mb 64] [--emu-kv-mb 32] [--emu-latency 20ms]

Everything a deployment with `security.tls.enabled` encrypts, on loopback and through the link
emulator (1 Gbit/s, --emu-latency one way), each pair measured alternately so load drifts hit both:

1. KV data plane: crossfill's TCP transfer (KVSender -> KVReceiver, codec none, up to 4 streams),
   goodput from open() to the commit's acknowledgement.
2. HTTP hop, warm: one small request on a kept-alive connection (a health probe, a route query).
3. HTTP hop, new connection: connect + handshake + one small request (what a fresh pool pays).
4. HTTP hop, bulk: a 16 MiB response (the scheduler's bandwidth probe, a long NDJSON stream).
5. KV data plane, small: one layer of 16 tokens, open() to the commit's acknowledgement. Every
   transfer opens its own connections, so this is the handshake a remote prefill pays per request.

The emulator accepts the TCP handshake at once (crossfill.net.linkemu), so through it a plaintext
connection costs no round trip and TLS's handshake shows as one extra round trip; on a real WAN
TCP's own round trip comes first for both.

The servers (KV receivers, uvicorn with the same ssl settings `crossfill serve` uses, the link
emulators) run in a separate process, so the sender does not share their interpreter lock; the
certificates come from crossfill.security.pki. Figures are medians of --runs (HTTP latencies: of
--runs x 20 requests); the ratio is TLS over plaintext (goodput: < 1 is slower; latency: > 1 is slower).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.assembler import Expectation
from crossfill.kv.tcp import KVReceiver, KVSender
from crossfill.kv.tls import client_context, server_context
from crossfill.kv.wire import Manifest
from crossfill.security.pki import write_dev_pki

HEADS, DIM, TOKENS = 2, 64, 4096
BULK = 16 << 20
SMALL_REQUESTS = 20


# ---------------------------------------------------------------------------------- server side

def _http_app():  # noqa: ANN202 - FastAPI only in the server process
    from fastapi import FastAPI
    from fastapi.responses import Response

    app = FastAPI()
    blob = bytes(BULK)

    @app.get("/small")
    async def small() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/bulk")
    async def bulk() -> Response:
        return Response(blob, media_type="application/octet-stream")

    return app


async def _uvicorn(tls: dict[str, object]) -> tuple[object, int]:
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0))
    # As uvicorn's own bind would get it from asyncio: without TCP_NODELAY a kept-alive connection
    # waits out the peer's delayed ACK (~40 ms) on every response (accepted sockets inherit it).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server = uvicorn.Server(uvicorn.Config(_http_app(), log_level="warning", access_log=False, lifespan="off", **tls))
    asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, sock.getsockname()[1]


def _server_main(pipe, pki: dict[str, str], bandwidth: str, latency: str) -> None:
    async def run() -> None:
        from crossfill.net.linkemu import LinkEmulator

        tls = server_context(pki["server_cert"], pki["server_key"], pki["ca"])
        rx = {"plain": await KVReceiver().start(), "tls": await KVReceiver(tls=tls).start()}
        uvicorn_tls = {"ssl_certfile": pki["server_cert"], "ssl_keyfile": pki["server_key"],
                       "ssl_ca_certs": pki["ca"], "ssl_cert_reqs": ssl.CERT_REQUIRED}
        http = {"plain": await _uvicorn({}), "tls": await _uvicorn(uvicorn_tls)}
        ports: dict[str, int] = {}
        emus = []
        for mode in ("plain", "tls"):
            ports[f"kv_{mode}"] = rx[mode].port
            ports[f"http_{mode}"] = http[mode][1]
            for kind, port in (("kv", rx[mode].port), ("http", http[mode][1])):
                emu = LinkEmulator(("127.0.0.1", port), bandwidth=bandwidth, latency=latency)
                await emu.start()
                emus.append(emu)
                ports[f"emu_{kind}_{mode}"] = emu.listen_port
        pipe.send(ports)
        loop = asyncio.get_running_loop()
        waits: set[asyncio.Task[object]] = set()
        while True:
            cmd = await loop.run_in_executor(None, pipe.recv)
            if cmd[0] == "stop":
                break
            _, mode, cache_id = cmd
            rx[mode].expect(Expectation(cache_id, lambda chunk: None, timeout_s=60.0))
            t = asyncio.create_task(rx[mode].wait(cache_id))
            waits.add(t)
            t.add_done_callback(waits.discard)
            pipe.send("ready")

    asyncio.run(run())


# ---------------------------------------------------------------------------------- client side

def make_cache(total_mb: int, tokens: int = TOKENS
               ) -> tuple[list[LayerSpec], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    per_layer = 2 * tokens * HEADS * DIM * 4
    layers = max(1, total_mb * (1 << 20) // per_layer)
    specs = [LayerSpec(i, "full", None, HEADS, DIM, torch.float32) for i in range(layers)]
    g = torch.Generator().manual_seed(0)
    kv = {s.index: (torch.randn(tokens, HEADS, DIM, generator=g), torch.randn(tokens, HEADS, DIM, generator=g))
          for s in specs}
    return specs, kv


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        self.pki = {k: str(v) for k, v in write_dev_pki(Path(self.tmp.name)).items()}
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, args=(child, self.pki, args.emu_bandwidth, args.emu_latency),
                                daemon=True)
        self.proc.start()
        self.ports: dict[str, int] = self.pipe.recv()
        self.senders: dict[int, KVSender] = {}
        self.n = 0

    def close(self) -> None:
        self.pipe.send(("stop",))
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
        self.tmp.cleanup()

    def client_ctx(self) -> ssl.SSLContext:
        return client_context(self.pki["ca"], self.pki["client_cert"], self.pki["client_key"])

    async def kv(self, mode: str, port: int, specs, kv, tokens: int = TOKENS) -> float:
        """Seconds from open() to the commit's acknowledgement."""
        self.n += 1
        cache_id = f"bench-{self.n}"
        self.pipe.send(("expect", mode, cache_id))
        assert self.pipe.recv() == "ready"
        if port not in self.senders:  # one sender per endpoint, as a prefill worker keeps them
            self.senders[port] = KVSender(("127.0.0.1", port), tls=self.client_ctx() if mode == "tls" else None,
                                          connections=4, timeout_ms=60_000)
        m = Manifest.build(cache_id=cache_id, request_id=cache_id, tenant="bench", fingerprint="bench",
                           token_ids=range(tokens), layer_specs=specs, codec="none", ttl_s=600)
        t0 = time.perf_counter()
        async with self.senders[port].open(m) as tx:
            for s in specs:
                await tx.send(LayerKVChunk(s.index, 0, *kv[s.index]))
            await tx.commit()
        return time.perf_counter() - t0

    def http_client(self, mode: str) -> httpx.Client:
        return httpx.Client(trust_env=False, timeout=60, **({"verify": self.client_ctx()} if mode == "tls" else {}))

    def url(self, mode: str, port: int) -> str:
        return f"{'https' if mode == 'tls' else 'http'}://127.0.0.1:{port}"

    def warm(self, mode: str, port: int) -> list[float]:
        with self.http_client(mode) as c:
            c.get(self.url(mode, port) + "/small")  # the connection is open and kept
            out = []
            for _ in range(SMALL_REQUESTS):
                t0 = time.perf_counter()
                c.get(self.url(mode, port) + "/small").raise_for_status()
                out.append(time.perf_counter() - t0)
        return out

    def cold(self, mode: str, port: int) -> list[float]:
        out = []
        for _ in range(SMALL_REQUESTS):
            with self.http_client(mode) as c:  # the context is built outside the timing: services keep theirs
                t0 = time.perf_counter()
                c.get(self.url(mode, port) + "/small").raise_for_status()
                out.append(time.perf_counter() - t0)
        return out

    def bulk(self, mode: str, port: int) -> float:
        with self.http_client(mode) as c:
            c.get(self.url(mode, port) + "/small")
            t0 = time.perf_counter()
            r = c.get(self.url(mode, port) + "/bulk")
            assert len(r.content) == BULK
            return time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def _row(name: str, plain: float, tls: float, unit: str, higher_is_better: bool) -> str:
    ratio = tls / plain
    verdict = (f"TLS = {ratio:.2f}x plaintext goodput" if higher_is_better
               else f"TLS = {ratio:.2f}x plaintext latency")
    return f"   {name:<34} plain {plain:9.2f} {unit:<6} TLS {tls:9.2f} {unit:<6} {verdict}"


async def amain(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    b = Bench(args)
    try:
        print(f"median of {args.runs} runs; emulated link {args.emu_bandwidth}, {args.emu_latency} one way")
        for where, kv_mb, prefix in (("loopback", args.kv_mb, ""), (f"emulated {args.emu_bandwidth}", args.emu_kv_mb,
                                                                      "emu_")):
            specs, kv = make_cache(kv_mb)
            small_specs, small_kv = make_cache(0, tokens=16)
            nbytes = sum(k.numel() * 4 * 2 for k, _ in kv.values())
            t: dict[str, list[float]] = {"plain": [], "tls": []}
            warm: dict[str, list[float]] = {"plain": [], "tls": []}
            cold: dict[str, list[float]] = {"plain": [], "tls": []}
            bulk: dict[str, list[float]] = {"plain": [], "tls": []}
            small: dict[str, list[float]] = {"plain": [], "tls": []}
            for _ in range(args.runs):
                for mode in ("plain", "tls"):
                    t[mode].append(await b.kv(mode, b.ports[f"{prefix}kv_{mode}"], specs, kv))
                    port = b.ports[f"{prefix}http_{mode}"]
                    warm[mode] += b.warm(mode, port)
                    cold[mode] += b.cold(mode, port)
                    bulk[mode].append(b.bulk(mode, port))
                    for _ in range(SMALL_REQUESTS // 4):
                        small[mode].append(await b.kv(mode, b.ports[f"{prefix}kv_{mode}"], small_specs, small_kv, 16))
            print(f"\n{where}: KV {nbytes / 2**20:.0f} MiB, HTTP bulk {BULK >> 20} MiB")
            gp = {m: nbytes / med(t[m]) / 1e6 for m in t}
            print(_row("1. KV data plane goodput", gp["plain"], gp["tls"], "MB/s", True))
            print(_row("2. HTTP small request, warm", med(warm["plain"]) * 1e3, med(warm["tls"]) * 1e3, "ms", False))
            print(_row("3. HTTP new connection + request", med(cold["plain"]) * 1e3, med(cold["tls"]) * 1e3, "ms",
                       False))
            bg = {m: BULK / med(bulk[m]) / 1e6 for m in bulk}
            print(_row("4. HTTP bulk response goodput", bg["plain"], bg["tls"], "MB/s", True))
            print(_row("5. KV small transfer (16 tokens)", med(small["plain"]) * 1e3, med(small["tls"]) * 1e3, "ms",
                       False))
    finally:
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="plaintext vs mutual TLS: KV data plane and HTTP hops")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--kv-mb", type=int, default=64, help="KV size on loopback")
    ap.add_argument("--emu-kv-mb", type=int, default=32, help="KV size through the emulated link")
    ap.add_argument("--emu-bandwidth", default="1gbit")
    ap.add_argument("--emu-latency", default="20ms")
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
