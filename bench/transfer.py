"""KV transfer goodput, side by side with baselines in the same run.

    .venv/bin/python bench/transfer.py [--mb 128] [--runs 3] [--connections 4] [--stripe-min-rtt-ms 5]
                                          [--emu-mb 64] [--skip-emu]

Sections (receiver, plain-socket server and link emulator run in a separate process, so sender
and receiver do not share one interpreter lock):

1. loopback: built-in transfer (codec none) vs a plain Python socket `sendall` of the same bytes
   to a `recv_into` loop: goodput and ratio (target >= 0.8x).
2. TLS overhead: the same transfer with mutual TLS vs without, and vs a plain blocking TLS socket
   `sendall` of the same bytes with the same certificates (what the cipher itself costs).
3. (numbered 6, run last) Mooncake Transfer Engine (TCP), when its wheel is available: one raw
   TE write of the same bytes, the TE backend, and the built-in TCP transfer against raw TE.
4. through the link emulator at 1 Gbit/s and 20 ms one way: goodput as % of the emulated
   bandwidth (target >= 90%), beside plain `sendall` through the same link.
5. layer-wise pipelining through the same link: time from the last layer produced to commit
   acknowledged, layer-wise vs sending the whole cache after prefill.

Goodput counts KV bytes only and runs from open() to the commit's acknowledgement (connection
set-up, manifest, commit round trip included). Each figure is the median of --runs.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import ssl
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path

import torch

from crossfill.engine.types import LayerKVChunk, LayerSpec
from crossfill.kv.assembler import Expectation
from crossfill.kv.tcp import KVReceiver, KVSender
from crossfill.kv.tls import client_context, server_context, write_dev_pki
from crossfill.kv.wire import Manifest

HEADS, DIM, TOKENS = 2, 64, 4096


# ---------------------------------------------------------------------------------- receiver side

def _plain_server(sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
    """Baseline: read a length-prefixed blob with recv_into, answer one byte (optionally over TLS)."""
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while True:
        conn, _ = sock.accept()
        if tls is not None:
            try:
                conn = tls.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError):
                conn.close()
                continue
        with conn:
            hdr = b""
            while len(hdr) < 8 and (got := conn.recv(8 - len(hdr))):  # TLS sockets take no MSG_WAITALL
                hdr += got
            if len(hdr) < 8:
                continue
            left = struct.unpack("!Q", hdr)[0]
            while left:
                n = conn.recv_into(view[:min(left, len(buf))])
                if not n:
                    break
                left -= n
            conn.sendall(b"k")


def _receiver_main(pipe, pki: dict[str, str], emu_bandwidth: str, emu_latency: str, te_bytes: int) -> None:
    async def run() -> None:
        from crossfill.net.linkemu import LinkEmulator

        plain = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_plain_server, args=(plain,), daemon=True).start()
        rx = await KVReceiver().start()
        tls = server_context(pki["server_cert"], pki["server_key"], pki["ca"])
        rx_tls = await KVReceiver(tls=tls).start()
        plain_tls = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_plain_server, args=(plain_tls, tls), daemon=True).start()
        emu_kv = LinkEmulator(upstream=("127.0.0.1", rx.port), bandwidth=emu_bandwidth, latency=emu_latency)
        emu_plain = LinkEmulator(upstream=plain.getsockname(), bandwidth=emu_bandwidth, latency=emu_latency)
        await emu_kv.start()
        await emu_plain.start()
        ports = {"kv": rx.port, "kv_tls": rx_tls.port, "plain": plain.getsockname()[1],
                 "plain_tls": plain_tls.getsockname()[1],
                 "emu_kv": emu_kv.listen_port, "emu_plain": emu_plain.listen_port}
        receivers = {"kv": rx, "kv_tls": rx_tls}
        try:  # Mooncake Transfer Engine: a raw buffer for the baseline and a TE backend receiver
            from crossfill.kv.mooncake_te import MooncakeTransferEngine
            from crossfill.kv.te_backend import TEReceiver

            te = MooncakeTransferEngine()
            raw = te.allocate(te_bytes)
            rx_te = await TEReceiver(te).start()
            receivers["kv_te"] = rx_te
            ports.update(te_raw=te.describe(raw).to_json(), kv_te=rx_te.port)
        except Exception as exc:  # the optional extra is missing: the section is skipped
            ports["te_error"] = f"{type(exc).__name__}: {exc}"
        pipe.send(ports)
        loop = asyncio.get_running_loop()
        waits: set[asyncio.Task[object]] = set()
        while True:
            cmd = await loop.run_in_executor(None, pipe.recv)
            if cmd[0] == "stop":
                break
            _, which, cache_id = cmd
            target = receivers[which]
            target.expect(Expectation(cache_id, lambda chunk: None, timeout_s=30.0))
            t = asyncio.create_task(target.wait(cache_id))
            waits.add(t)
            t.add_done_callback(waits.discard)
            pipe.send("ready")

    asyncio.run(run())


# ------------------------------------------------------------------------------------ sender side

def make_cache(total_mb: int) -> tuple[list[LayerSpec], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    per_layer = 2 * TOKENS * HEADS * DIM * 4
    layers = max(1, total_mb * (1 << 20) // per_layer)
    specs = [LayerSpec(i, "full", None, HEADS, DIM, torch.float32) for i in range(layers)]
    g = torch.Generator().manual_seed(0)
    kv = {s.index: (torch.randn(TOKENS, HEADS, DIM, generator=g), torch.randn(TOKENS, HEADS, DIM, generator=g))
          for s in specs}
    return specs, kv


def manifest_for(specs: list[LayerSpec], cache_id: str) -> Manifest:
    return Manifest.build(cache_id=cache_id, request_id=cache_id, tenant="bench", fingerprint="bench",
                          token_ids=range(TOKENS), layer_specs=specs, codec="none", ttl_s=600)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = tempfile.TemporaryDirectory()
        self.pki = {k: str(v) for k, v in write_dev_pki(Path(self.tmp.name)).items()}
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child, self.pki, args.emu_bandwidth, args.emu_latency,
                                                                     args.mb << 20),
                                daemon=True)
        self.proc.start()
        self.ports = self.pipe.recv()
        self.n = 0
        self.streams = 0  # parallel streams the last built-in transfer opened
        self.senders: dict[tuple[int, bool], KVSender] = {}

    def close(self) -> None:
        self.pipe.send(("stop",))
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
        self.tmp.cleanup()

    def plain(self, port: int, blob: memoryview, tls: bool = False) -> float:
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as raw:
            s = raw
            if tls:  # the blocking ssl module releases the interpreter lock while it encrypts
                ctx = client_context(self.pki["ca"], self.pki["client_cert"], self.pki["client_key"])
                s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            s.sendall(struct.pack("!Q", len(blob)))
            s.sendall(blob)
            if s.recv(1) != b"k":
                raise RuntimeError("plain baseline: no acknowledgement")
        return time.perf_counter() - t0

    def te_raw(self, engine, src, nbytes: int) -> float:
        """Baseline: one Mooncake TE write of the same bytes into the receiver's registered buffer."""
        from crossfill.kv.mooncake_te import BufferDescriptor

        dest = BufferDescriptor.from_json(self.ports["te_raw"])
        t0 = time.perf_counter()
        engine.write(src, dest, nbytes)
        return time.perf_counter() - t0

    async def kv(self, which: str, port: int, specs, kv, tls: bool = False, compute_s: float = 0.0,
                 after_prefill: bool = False, sender=None) -> tuple[float, float]:
        """Return (seconds open->commit acknowledged, seconds last layer produced->commit acknowledged)."""
        self.n += 1
        cache_id = f"bench-{self.n}"
        self.pipe.send(("expect", which, cache_id))
        assert self.pipe.recv() == "ready"
        ctx = client_context(self.pki["ca"], self.pki["client_cert"], self.pki["client_key"]) if tls else None
        if sender is None:  # one sender per endpoint, as a prefill worker keeps them (it remembers the RTT)
            key = (port, tls)
            if key not in self.senders:
                self.senders[key] = KVSender(("127.0.0.1", port), tls=ctx, connections=self.args.connections,
                                             timeout_ms=30_000, stripe_min_rtt_ms=self.args.stripe_min_rtt_ms)
            sender = self.senders[key]
        m = manifest_for(specs, cache_id)
        t0 = time.perf_counter()
        async with sender.open(m) as tx:
            if after_prefill:
                await asyncio.sleep(compute_s * len(specs))
            for s in specs:
                if compute_s and not after_prefill:
                    await asyncio.sleep(compute_s)
                await tx.send(LayerKVChunk(s.index, 0, *kv[s.index]))
            t_last = time.perf_counter() if not after_prefill else t0 + compute_s * len(specs)
            self.streams = (await tx.commit()).streams
        t1 = time.perf_counter()
        return t1 - t0, t1 - t_last


def med(xs: list[float]) -> float:
    return statistics.median(xs)


async def amain(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    b = Bench(args)
    try:
        specs, kv = make_cache(args.mb)
        nbytes = sum(k.numel() * 4 * 2 for k, _ in kv.values())
        blob = memoryview(b"".join(bytes(k.numpy().tobytes()) + bytes(v.numpy().tobytes()) for k, v in kv.values()))
        print(f"KV: {len(specs)} layers x {TOKENS} tokens x {HEADS} heads x {DIM} dim fp32 = {nbytes / 2**20:.0f} MiB, "
              f"{args.connections} connections, median of {args.runs} runs")

        plain_t, kv_t, tls_t, plain_tls_t = [], [], [], []
        for _ in range(args.runs):
            plain_t.append(b.plain(b.ports["plain"], blob))
            kv_t.append((await b.kv("kv", b.ports["kv"], specs, kv))[0])
            streams = b.streams
            tls_t.append((await b.kv("kv_tls", b.ports["kv_tls"], specs, kv, tls=True))[0])
            plain_tls_t.append(b.plain(b.ports["plain_tls"], blob, tls=True))
        gp = {name: nbytes / med(t) / 1e6 for name, t in (("plain", plain_t), ("kv", kv_t), ("tls", tls_t),
                                                             ("plain_tls", plain_tls_t))}
        print("\n1. loopback goodput")
        print(f"   plain socket sendall : {gp['plain']:8.0f} MB/s")
        print(f"   crossfill TCP        : {gp['kv']:8.0f} MB/s   = {gp['kv'] / gp['plain']:.2f}x plain (target >= 0.8x); "
              f"{streams} of {args.connections} streams opened")
        print("\n2. TLS overhead")
        print(f"   crossfill TCP + mTLS : {gp['tls']:8.0f} MB/s   = {gp['tls'] / gp['kv']:.2f}x without TLS "
              f"({(1 - gp['tls'] / gp['kv']) * 100:.0f}% overhead)")
        print(f"   plain TLS socket     : {gp['plain_tls']:8.0f} MB/s   (blocking ssl sendall, same certificates); "
              f"crossfill + mTLS = {gp['tls'] / gp['plain_tls']:.2f}x of it")
        # Mooncake TE last: a crash inside its C++ engine must not take the other sections with it.
        async def te_section() -> None:
            print("\n6. Mooncake Transfer Engine (TCP), same bytes")
            if "te_error" in b.ports:
                print(f"   skipped: {b.ports['te_error']}")
            else:
                from crossfill.kv.mooncake_te import MooncakeTransferEngine
                from crossfill.kv.te_backend import TESender

                engine = MooncakeTransferEngine()
                src = engine.register(bytearray(blob))
                te_raw_t, te_kv_t = [], []
                for _ in range(args.runs):
                    te_raw_t.append(b.te_raw(engine, src, nbytes))
                    te_kv_t.append((await b.kv("kv_te", b.ports["kv_te"], specs, kv,
                                               sender=TESender(("127.0.0.1", b.ports["kv_te"]), engine,
                                                               timeout_ms=30_000)))[0])
                te_raw, te_kv = nbytes / med(te_raw_t) / 1e6, nbytes / med(te_kv_t) / 1e6
                print(f"   raw TE write         : {te_raw:8.0f} MB/s")
                print(f"   crossfill TE backend : {te_kv:8.0f} MB/s   (verified frames over TE)")
                print(f"   crossfill TCP        : {gp['kv']:8.0f} MB/s   = {gp['kv'] / te_raw:.2f}x raw TE (target >= 1.0x)")

        if args.skip_emu:
            await te_section()
            return
        emu_specs, emu_kv = make_cache(args.emu_mb)
        emu_bytes = sum(k.numel() * 4 * 2 for k, _ in emu_kv.values())
        emu_blob = memoryview(b"".join(k.numpy().tobytes() + v.numpy().tobytes() for k, v in emu_kv.values()))
        bw = float(args.emu_bandwidth_bps)
        ep, ek = [], []
        for _ in range(args.runs):
            ep.append(b.plain(b.ports["emu_plain"], emu_blob))
            ek.append((await b.kv("kv", b.ports["emu_kv"], emu_specs, emu_kv))[0])
        print(f"\n4. through the link emulator ({args.emu_bandwidth}, {args.emu_latency} one way), "
              f"{emu_bytes / 2**20:.0f} MiB")
        for name, t in (("plain socket sendall", ep), ("crossfill TCP", ek)):
            g = emu_bytes * 8 / med(t)
            print(f"   {name:<21}: {g / 1e6:8.0f} Mbit/s = {g / bw * 100:5.1f}% of the link")
        print(f"   (crossfill TCP opened {b.streams} of {args.connections} streams)")
        print("   (target for crossfill TCP: >= 90%)")

        layer_tx = 2 * TOKENS * HEADS * DIM * 4 * 8 / bw
        compute = layer_tx * 1.2
        tails_pipe, tails_after = [], []
        for _ in range(args.runs):
            tails_pipe.append((await b.kv("kv", b.ports["emu_kv"], emu_specs, emu_kv, compute_s=compute))[1])
            tails_after.append((await b.kv("kv", b.ports["emu_kv"], emu_specs, emu_kv, compute_s=compute,
                                           after_prefill=True))[1])
        rtt = 2 * float(args.emu_latency.rstrip("ms")) / 1e3
        print(f"\n5. layer-wise pipelining through the same link ({len(emu_specs)} layers, "
              f"prefill {compute * 1e3:.1f} ms/layer, one layer on the wire {layer_tx * 1e3:.1f} ms, RTT {rtt * 1e3:.0f} ms)")
        print(f"   tail, layer by layer     : {med(tails_pipe) * 1e3:7.1f} ms "
              f"(one layer + RTT = {(layer_tx + rtt) * 1e3:.1f} ms)")
        print(f"   tail, whole cache after  : {med(tails_after) * 1e3:7.1f} ms")
        print(f"   pipelining cuts the tail by {med(tails_after) / med(tails_pipe):.1f}x")
        await te_section()
    finally:
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="KV transfer goodput vs baselines")
    ap.add_argument("--mb", type=int, default=128, help="KV size for the loopback sections")
    ap.add_argument("--emu-mb", type=int, default=64, help="KV size for the emulated-link sections")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--connections", type=int, default=4, help="most parallel streams per transfer")
    ap.add_argument("--stripe-min-rtt-ms", type=float, default=5.0,
                    help="open more than one stream only on a round trip this long (0: always)")
    ap.add_argument("--emu-bandwidth", default="1gbit")
    ap.add_argument("--emu-latency", default="20ms")
    ap.add_argument("--skip-emu", action="store_true")
    args = ap.parse_args()
    from crossfill.net.units import parse_bandwidth

    args.emu_bandwidth_bps = parse_bandwidth(args.emu_bandwidth)
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
