"""Mooncake Transfer Engine over TCP, for real between two processes on loopback."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from .conftest import needs_mooncake

pytestmark = [pytest.mark.mooncake, needs_mooncake, pytest.mark.timeout(120)]

RECEIVER = """
import sys, hashlib
from crossfill.kv.mooncake_te import MooncakeTransferEngine
te = MooncakeTransferEngine()
buf = te.allocate(int(sys.argv[1]))
buf.array[:16] = 7  # so a one-sided read has something known to fetch
print(te.describe(buf).to_json(), flush=True)
for line in sys.stdin:
    if line.strip() == "digest":
        print(hashlib.sha256(buf.array).hexdigest(), flush=True)
"""


def _start_receiver():
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(4 << 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    from crossfill.kv.mooncake_te import BufferDescriptor

    line = proc.stdout.readline()
    assert line, "the receiver process did not start"
    return proc, BufferDescriptor.from_json(line)


def _stop_receiver(proc) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(30)


@pytest.fixture(scope="module")
def receiver():
    proc, dest = _start_receiver()
    yield proc, dest
    _stop_receiver(proc)


def _remote_digest(proc) -> str:
    proc.stdin.write("digest\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


@pytest.fixture(scope="module")
def engine():
    from crossfill.kv.mooncake_te import MooncakeTransferEngine

    te = MooncakeTransferEngine()
    yield te
    te.close()


def test_write_and_read_between_two_processes(engine, receiver):
    proc, dest = receiver
    assert dest.nbytes == 4 << 20 and dest.session_id.startswith("127.0.0.1:")
    src = engine.allocate(dest.nbytes)
    src.array[:] = np.random.default_rng(1).integers(0, 256, dest.nbytes, dtype=np.uint8)
    expected = src.array.copy()
    expected[:16] = 7  # the receiver's own first 16 bytes stay: we write from offset 16 on
    engine.write(src, dest, nbytes=dest.nbytes - 16, src_offset=16, dest_offset=16)
    assert _remote_digest(proc) == hashlib.sha256(expected).hexdigest()

    back = engine.register(bytearray(64))  # any writable buffer can be registered
    engine.read(back, dest, nbytes=32)
    assert bytes(back.array[:32]) == bytes(expected[:32])
    engine.unregister(back)


def test_out_of_range_is_refused_before_anything_moves(engine, receiver):
    from crossfill.kv.mooncake_te import MooncakeTEError

    proc, dest = receiver
    before = _remote_digest(proc)
    src = engine.allocate(dest.nbytes)
    src.array[:] = 1
    with pytest.raises(MooncakeTEError, match="peer range .* exceeds its 4194304-byte buffer"):
        engine.write(src, dest, dest_offset=1)
    with pytest.raises(MooncakeTEError, match="local range"):
        engine.write(src, dest, nbytes=10, src_offset=dest.nbytes - 5)
    with pytest.raises(MooncakeTEError, match="read-only"):
        engine.register(b"immutable")
    assert _remote_digest(proc) == before
    engine.unregister(src)


def test_write_to_a_peer_that_exited_fails_clearly(engine):
    from crossfill.kv.mooncake_te import MooncakeTEError

    proc, dest = _start_receiver()
    _stop_receiver(proc)
    src = engine.allocate(1024)
    with pytest.raises(MooncakeTEError, match=f"write of 1024 bytes to {dest.session_id} failed"):
        engine.write(src, dest)
    engine.unregister(src)


def test_descriptor_json():
    from crossfill.kv.mooncake_te import BufferDescriptor, MooncakeTEError

    d = BufferDescriptor("127.0.0.1:1234", 140000000, 4096)
    assert BufferDescriptor.from_json(d.to_json()) == d
    with pytest.raises(MooncakeTEError, match="bad buffer descriptor"):
        BufferDescriptor.from_json('{"session_id": "x"}')
