"""Start and stop a real `mooncake_master` (from the `mooncake-transfer-engine-non-cuda` wheel).

Mooncake Store clients need a master: it owns object metadata and placement; the bytes live in
memory segments that clients contribute. Tests and single-machine deployments start one here on
loopback with free ports. Clients use the `P2PHANDSHAKE` metadata mode (peers exchange transfer
metadata directly), so no etcd or HTTP metadata server is needed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from crossfill.kv.store.base import StoreUnavailableError


def find_master_binary() -> Path:
    """The `mooncake_master` executable shipped inside the wheel (the bin/ shim is a Python script)."""
    try:
        import mooncake
    except ImportError as exc:
        raise StoreUnavailableError(
            f"Mooncake is not installed ({exc}): pip install 'crossfill[mooncake]' "
            "(the mooncake-transfer-engine-non-cuda wheel; it also needs libibverbs1 from the OS)"
        ) from exc
    candidate = Path(mooncake.__file__).parent / "mooncake_master"
    if candidate.is_file():
        return candidate
    found = shutil.which("mooncake_master") or str(Path(sys.prefix) / "bin" / "mooncake_master")
    if not Path(found).is_file():
        raise StoreUnavailableError("mooncake_master not found in the mooncake package nor on PATH")
    return Path(found)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """A `mooncake_master` child process bound to `host` (loopback by default).

    Args:
        rpc_port / metrics_port: 0 picks free ports.
        lease_ttl_ms: Mooncake's per-object read lease (an object being read cannot be removed
            without force). Short leases keep eviction responsive in tests.
        log_dir: where the master's output goes (default: discarded).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        metrics_port: int = 0,
        lease_ttl_ms: int = 1000,
        log_dir: str | os.PathLike[str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.lease_ttl_ms = lease_ttl_ms
        self.log_dir = Path(log_dir) if log_dir else None
        self.extra_args = extra_args
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def address(self) -> str:
        """What clients pass as `master_server_addr`."""
        return f"{self.host}:{self.rpc_port}"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        args = [
            str(find_master_binary()),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--enable_http_metadata_server=false",
            *self.extra_args,
        ]
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = self._log = open(self.log_dir / "mooncake_master.log", "ab")  # noqa: SIM115
        self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise StoreUnavailableError(
                    f"mooncake_master exited with code {self._proc.returncode} at start "
                    f"(args: {' '.join(args[1:])}); pass log_dir to see its output"
                )
            try:
                with socket.create_connection((self.host, self.rpc_port), timeout=0.5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise StoreUnavailableError(
                        f"mooncake_master did not listen on {self.address} within {timeout_s:g} s"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
