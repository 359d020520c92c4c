"""`crossfill up`: a whole topology on this machine, each role in its own process.

Starts the WAN emulators first (so remote instances are reachable through them from the start),
the Mooncake Store master when `kv_cache.start_mooncake_master` asks for it (workers connect to it
as they start, so `up` waits until it listens), then the workers, the scheduler and the gateway; waits until every one answers `/readyz`, prints
where the API is, and keeps watch. Ctrl-C or SIGTERM (or any child dying) stops everything:
SIGTERM to each child, then SIGKILL after a grace period, so no orphan keeps a port or a model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from crossfill.config import ConfigError, CrossfillConfig, load_config

_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    ready_url: str | None


def _spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
    # A new session: the terminal's Ctrl-C reaches only `up`, which then stops children in order.
    return subprocess.Popen([sys.executable, *args], start_new_session=True, env={**os.environ,
                            "PYTHONUNBUFFERED": "1"})


def _mooncake_master(address: str) -> subprocess.Popen[bytes]:
    from crossfill.kv.store.mooncake_master import find_master_binary

    host, _, port = address.rpartition(":")
    args = [str(find_master_binary()), f"--rpc_address={host}", f"--rpc_port={port}",
            "--enable_http_metadata_server=false", "--default_kv_lease_ttl=1000"]
    proc = subprocess.Popen(args, start_new_session=True, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise ConfigError(f"mooncake_master exited with status {proc.returncode} at start on {address} "
                              "(inference_service.kv_cache.mooncake_master): is the port free?")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise ConfigError(f"mooncake_master did not listen on {address} within 20 s") from None
            time.sleep(0.05)


def start_children(cfg: CrossfillConfig, config_path: str) -> list[Child]:
    children: list[Child] = []
    if cfg.crossings():
        children.append(Child("links", _spawn("links", ["-m", "crossfill.serving.links", config_path]), None))
    kv = cfg.inference_service.kv_cache
    if kv.start_mooncake_master and kv.mooncake_master is not None:
        try:
            children.append(Child("mooncake_master", _mooncake_master(kv.mooncake_master), None))
        except Exception:
            stop_children(children)  # the emulators already run: leave nothing behind
            raise
    order = sorted(cfg.instances(), key=lambda i: {"prefill": 0, "decode": 1, "scheduler": 2, "gateway": 3}[i.role])
    for inst in order:
        args = ["-m", "crossfill.cli", "serve", inst.role, "--config", config_path]
        if inst.role in ("prefill", "decode"):
            args += ["--instance", inst.name]
        children.append(Child(inst.name, _spawn(inst.name, args), inst.url + "/readyz"))
    return children


def stop_children(children: list[Child]) -> None:
    for c in reversed(children):
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for c in children:
        left = max(deadline - time.monotonic(), 0.1)
        try:
            c.proc.wait(left)
        except subprocess.TimeoutExpired:
            print(f"crossfill up: {c.name} did not stop in {_GRACE_S:.0f}s, killing it", file=sys.stderr)
            c.proc.kill()
            c.proc.wait()


def wait_ready(children: list[Child], timeout_s: float, stopping: list[bool]) -> str | None:
    """None when every child is ready; else why not (a child exited, timeout, or a signal)."""
    pending = {c.name: c for c in children if c.ready_url}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            if stopping[0]:
                return "interrupted"
            for c in children:
                if c.proc.poll() is not None:
                    return f"{c.name} exited with status {c.proc.returncode} during start-up"
            for name, c in list(pending.items()):
                try:
                    if client.get(c.ready_url).status_code == 200:  # type: ignore[arg-type]
                        print(f"crossfill up: {name} ready", file=sys.stderr)
                        del pending[name]
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                return f"not ready after {timeout_s:.0f}s: {', '.join(pending)}"
            time.sleep(0.3)
    return None


def run_up(config_path: str) -> int:
    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    stopping = [False]

    def on_signal(signum: int, _frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        children = start_children(cfg, config_path)
    except Exception as exc:  # noqa: BLE001 - the reason is printed; nothing was left running
        print(f"crossfill up: cannot start: {exc}", file=sys.stderr)
        return 1
    status = 0
    try:
        why = wait_ready(children, cfg.serving.startup_timeout_s, stopping)
        if why is not None:
            print(f"crossfill up: {why}; stopping everything", file=sys.stderr)
            return 0 if why == "interrupted" else 1
        gw = cfg.topology.gateway
        print(f"crossfill is up: OpenAI-compatible API at http://{gw.host}:{gw.port}/v1 "
              f"(model {cfg.model.api_name}); native POST /v1/generate; Ctrl-C stops everything.", flush=True)
        while not stopping[0]:
            for c in children:
                if c.proc.poll() is not None:
                    print(f"crossfill up: {c.name} exited with status {c.proc.returncode}; stopping everything",
                          file=sys.stderr)
                    status = 1
                    stopping[0] = True
                    break
            time.sleep(0.2)
        return status
    finally:
        stop_children(children)
        print("crossfill up: stopped", file=sys.stderr)
