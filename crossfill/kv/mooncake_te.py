"""A thin byte-level wrapper over Mooncake Transfer Engine (TE), for a KV transfer backend.

Mooncake TE moves bytes between *registered* memory of two processes, one-sided: the sender writes
straight into the receiver's buffer (or the receiver reads from the sender's), with no receive
call on the other side. Here it runs over its TCP transport (RDMA needs RDMA NICs). The
`mooncake-transfer-engine-non-cuda` wheel is an optional extra, and it needs the OS library
libibverbs1 even for TCP.

The protocol around it is the caller's: the receiver allocates a buffer, sends its
`BufferDescriptor` (session id, address, size; JSON-friendly) to the sender over the control plane,
the sender calls `write()`, then tells the receiver the bytes are there (TE does not notify). Peers
find each other with `P2PHANDSHAKE` (no metadata service): a session id is 'host:rpc_port'.

Every call but `submit_write` is blocking (TE's *sync* API); asyncio callers use
`asyncio.to_thread`.  `submit_write` starts a write and returns a `PendingWrite` to poll, so one
caller can keep several writes in flight without a thread each (TE's sync write spins a core
until its write completes).

    python -m crossfill.kv.mooncake_te --size-mb 128 --repeats 3
measures TE goodput between two processes on loopback beside a plain socket `sendall` of the same
bytes (see `bench_main`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


class MooncakeTEError(RuntimeError):
    """A Transfer Engine operation failed; the message names the operation, peer and likely cause."""


class MooncakeUnavailableError(MooncakeTEError):
    """The mooncake wheel is missing or cannot load (e.g. libibverbs1 is not installed)."""


@dataclass(frozen=True)
class BufferDescriptor:
    """Where a peer can write/read: what a receiver sends to a sender (as JSON) before a transfer."""

    session_id: str  # 'host:rpc_port' of the engine that registered the buffer
    address: int
    nbytes: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> BufferDescriptor:
        try:
            d = json.loads(text)
            return cls(session_id=str(d["session_id"]), address=int(d["address"]), nbytes=int(d["nbytes"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise MooncakeTEError(f"bad buffer descriptor {text!r}: {exc}") from exc


@dataclass(frozen=True)
class RegisteredBuffer:
    """Memory registered with an engine. `array` (uint8) keeps it alive; use it to fill or read."""

    array: np.ndarray
    address: int
    nbytes: int


# TE hands back a batch id (a pointer into its memory) for a submitted write; 0, a negative value
# or -1 seen as an unsigned 64-bit number means the submission failed.
_BAD_BATCH_IDS = (0, (1 << 64) - 1)


class PendingWrite:
    """A TE write in flight (see `MooncakeTransferEngine.submit_write`): poll it until it finishes.

    It keeps the source memory alive until then, since TE reads it after the submitting call returned.
    """

    def __init__(self, engine: Any, batch_id: int, nbytes: int, peer: str, src: RegisteredBuffer) -> None:
        self._engine = engine
        self._batch_id = batch_id
        self.nbytes = nbytes
        self.peer = peer
        self._src: RegisteredBuffer | None = src
        self.finished = False  # TE has released the batch (done, failed or timed out)
        self.timed_out = False  # TE gave up but may still hold the batch, and so the source memory
        self._error: MooncakeTEError | None = None

    def poll(self) -> bool:
        """True once the bytes are in the peer's buffer, False while in flight; raises MooncakeTEError if it failed.

        Never blocks. Once it returned True or raised, TE is not asked again: the wheel frees a
        finished batch when it reports it, and asking about a freed batch id reads freed memory.
        """
        if self._error is not None:
            raise self._error
        if self.finished:
            return True
        rc = self._engine.transfer_check_status(self._batch_id)
        if rc == 0:
            return False
        self.finished = True
        self._src = None
        if rc == 1:
            return True
        self.timed_out = rc == -2
        what = "timed out inside TE" if self.timed_out else f"failed with status {rc}"
        self._error = MooncakeTEError(
            f"Mooncake TE write of {self.nbytes} bytes to {self.peer} {what}: the peer exited, is "
            "unreachable, or no longer has that buffer registered"
        )
        raise self._error


def _import_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeUnavailableError(
            f"Mooncake Transfer Engine cannot be imported ({exc}): pip install 'crossfill[mooncake]' "
            "and the OS package libibverbs1 (needed even for the TCP transport)"
        ) from exc
    return TransferEngine


class MooncakeTransferEngine:
    """One Mooncake TE instance of this process (create one per process and share it).

    Args:
        hostname: address peers use to reach this engine (loopback in tests).
        metadata_server: 'P2PHANDSHAKE', or an etcd/http metadata URL of a Mooncake deployment.
        protocol: 'tcp' (works everywhere) or 'rdma'.
    """

    def __init__(
        self, hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp"
    ) -> None:
        self._engine = _import_engine()()
        rc = self._engine.initialize(hostname, metadata_server, protocol, "")
        if rc != 0:
            raise MooncakeTEError(
                f"Mooncake TE initialize(hostname={hostname!r}, metadata={metadata_server!r}, "
                f"protocol={protocol!r}) failed with code {rc}"
            )
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._buffers: dict[int, RegisteredBuffer] = {}

    def allocate(self, nbytes: int) -> RegisteredBuffer:
        """A zero-filled buffer of `nbytes`, registered so peers can write into or read from it."""
        if nbytes <= 0:
            raise MooncakeTEError(f"cannot allocate a buffer of {nbytes} bytes: the size must be > 0")
        return self.register(np.zeros(nbytes, dtype=np.uint8))

    def register(self, buffer: Any) -> RegisteredBuffer:
        """Register existing writable, contiguous memory (numpy array, bytearray, CPU tensor's numpy)."""
        try:
            array = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
            array = array.reshape(-1).view(np.uint8)
        except (TypeError, ValueError) as exc:
            raise MooncakeTEError(
                f"cannot register {type(buffer).__name__}: not a contiguous buffer ({exc})"
            ) from exc
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise MooncakeTEError(
                "can only register writable, C-contiguous memory (bytes objects are read-only)"
            )
        reg = RegisteredBuffer(array, array.ctypes.data, array.nbytes)
        rc = self._engine.register_memory(reg.address, reg.nbytes)
        if rc != 0:
            raise MooncakeTEError(f"Mooncake TE register_memory of {reg.nbytes} bytes failed with code {rc}")
        self._buffers[reg.address] = reg
        return reg

    def unregister(self, buffer: RegisteredBuffer) -> None:
        if self._buffers.pop(buffer.address, None) is not None:
            self._engine.unregister_memory(buffer.address)

    def describe(self, buffer: RegisteredBuffer) -> BufferDescriptor:
        """The descriptor to hand to a peer so it can write into / read from `buffer`."""
        return BufferDescriptor(self.session_id, buffer.address, buffer.nbytes)

    def write(self, src: RegisteredBuffer, dest: BufferDescriptor, nbytes: int | None = None,
              src_offset: int = 0, dest_offset: int = 0) -> None:
        """Copy `nbytes` (default: all of `src` from `src_offset`) into the peer's buffer; blocks."""
        self._transfer_sync("write", src, dest, nbytes, src_offset, dest_offset)

    def submit_write(self, src: RegisteredBuffer, dest: BufferDescriptor, nbytes: int | None = None,
                     src_offset: int = 0, dest_offset: int = 0) -> PendingWrite:
        """Start copying `nbytes` into the peer's buffer and return at once; poll the result.

        Same arguments as `write`. `src` must stay registered and unchanged in that range until
        the write finished (`PendingWrite.poll` returned True or raised). Raises MooncakeTEError
        if TE refuses the submission (e.g. it cannot reach the peer's engine).
        """
        n = self._check_range("write", src, dest, nbytes, src_offset, dest_offset)
        batch_id = self._engine.transfer_submit_write(
            dest.session_id, src.address + src_offset, dest.address + dest_offset, n
        )
        if batch_id < 0 or batch_id in _BAD_BATCH_IDS:
            raise MooncakeTEError(
                f"Mooncake TE could not submit a write of {n} bytes to {dest.session_id} (code "
                f"{batch_id}): the peer's engine is unreachable or exited"
            )
        return PendingWrite(self._engine, batch_id, n, dest.session_id, src)

    def read(self, dst: RegisteredBuffer, src: BufferDescriptor, nbytes: int | None = None,
             dst_offset: int = 0, src_offset: int = 0) -> None:
        """Copy `nbytes` from the peer's buffer into `dst`; blocks."""
        self._transfer_sync("read", dst, src, nbytes, dst_offset, src_offset)

    def _transfer_sync(self, op: str, local: RegisteredBuffer, peer: BufferDescriptor, nbytes: int | None,
                       local_offset: int, peer_offset: int) -> None:
        """A blocking write (local -> peer) or read (peer -> local) of `nbytes`."""
        n = self._check_range(op, local, peer, nbytes, local_offset, peer_offset)
        call = self._engine.transfer_sync_write if op == "write" else self._engine.transfer_sync_read
        rc = call(peer.session_id, local.address + local_offset, peer.address + peer_offset, n)
        if rc != 0:
            raise MooncakeTEError(
                f"Mooncake TE {op} of {n} bytes {'to' if op == 'write' else 'from'} {peer.session_id} failed "
                f"with code {rc}: the peer exited, is unreachable, or no longer has that buffer registered"
            )

    def close(self) -> None:
        """Unregister every buffer (the engine itself lives until the process exits)."""
        for buf in list(self._buffers.values()):
            self.unregister(buf)

    @staticmethod
    def _check_range(
        op: str,
        local: RegisteredBuffer,
        peer: BufferDescriptor,
        nbytes: int | None,
        local_off: int,
        peer_off: int,
    ) -> int:
        n = local.nbytes - local_off if nbytes is None else nbytes
        if n <= 0 or local_off < 0 or peer_off < 0:
            raise MooncakeTEError(f"{op}: nothing to move (nbytes={n}, offsets {local_off}, {peer_off})")
        if local_off + n > local.nbytes:
            raise MooncakeTEError(
                f"{op}: local range [{local_off}, {local_off + n}) exceeds the {local.nbytes}-byte buffer"
            )
        if peer_off + n > peer.nbytes:
            raise MooncakeTEError(
                f"{op}: peer range [{peer_off}, {peer_off + n}) exceeds its {peer.nbytes}-byte buffer "
                f"on {peer.session_id}"
            )
        return n


# ---------------------------------------------------------------------- loopback benchmark

_RECEIVER = """
import sys, hashlib
from crossfill.kv.mooncake_te import MooncakeTransferEngine
te = MooncakeTransferEngine()
buf = te.allocate(int(sys.argv[1]))
print(te.describe(buf).to_json(), flush=True)
for line in sys.stdin:
    if line.strip() == "digest":
        print(hashlib.blake2b(buf.array, digest_size=16).hexdigest(), flush=True)
"""


def _socket_goodput(payload: np.ndarray) -> float:
    """Seconds to `sendall` the payload to another process that reads it all and acks (the baseline)."""
    import socket

    sink = (
        "import socket,sys\n"
        "s=socket.create_server(('127.0.0.1',0));print(s.getsockname()[1],flush=True)\n"
        "c,_=s.accept();n=int(sys.argv[1]);b=bytearray(4<<20);m=memoryview(b);got=0\n"
        "while got<n:\n  k=c.recv_into(m);got+=k\n  assert k\n"
        "c.sendall(b'k')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", sink, str(payload.nbytes)], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.perf_counter()
            s.sendall(memoryview(payload))
            assert s.recv(1) == b"k"
            return time.perf_counter() - t0
    finally:
        proc.wait(30)


def bench_main(argv: list[str] | None = None) -> None:
    """Median goodput of Mooncake TE (TCP) vs a plain socket, between two processes on loopback."""
    ap = argparse.ArgumentParser(description=bench_main.__doc__)
    ap.add_argument("--size-mb", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    nbytes = args.size_mb << 20
    te = MooncakeTransferEngine()
    src = te.allocate(nbytes)
    src.array[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    proc = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        dest = BufferDescriptor.from_json(proc.stdout.readline())  # type: ignore[union-attr]
        te.write(src, dest)  # warm-up: the first write also sets up TE's connection to the peer
        te_times, sock_times = [], []
        for _ in range(args.repeats):  # interleaved so both see the same machine load
            t0 = time.perf_counter()
            te.write(src, dest)
            te_times.append(time.perf_counter() - t0)
            sock_times.append(_socket_goodput(src.array))
        proc.stdin.write("digest\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        import hashlib

        ok = proc.stdout.readline().strip() == hashlib.blake2b(src.array, digest_size=16).hexdigest()  # type: ignore[union-attr]
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(30)
    te_gbps = nbytes * 8 / statistics.median(te_times) / 1e9
    sock_gbps = nbytes * 8 / statistics.median(sock_times) / 1e9
    print(f"payload {args.size_mb} MiB, {args.repeats} runs each, medians, two processes on loopback")
    print(f"plain socket sendall   : {sock_gbps:7.2f} Gbit/s  (baseline)")
    print(
        f"Mooncake TE tcp write  : {te_gbps:7.2f} Gbit/s  ratio {te_gbps / sock_gbps:.2f}x  data intact: {ok}"
    )


if __name__ == "__main__":
    bench_main()
