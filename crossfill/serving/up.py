"""`crossfill up`: a whole topology on this machine, each role in its own process, supervised.

Starts the WAN emulators first (so remote instances are reachable through them from the start),
the Mooncake Store master when `kv_cache.start_mooncake_master` asks for it (workers connect to it
as they start, so `up` waits until it listens), then the workers, the scheduler and the gateway;
waits until every one answers `/readyz` and prints where the API is.

Then it supervises like a process manager: a child that exits (crash, kill -9, or a graceful
SIGTERM drain) is started again after a backoff (0.5 s, doubling per death that comes soon after
a start, up to `serving.restart_backoff_max_s`) and rejoins by itself — the scheduler takes a
worker back when its health probe succeeds, the gateway re-reads the scheduler's readiness. The
others keep serving meanwhile: a dead remote prefill degrades routing to local, visibly (the
route's degradation reason). A child that dies during start-up still stops everything (that is a
configuration problem, not a crash). Only Ctrl-C or SIGTERM to `up` stops everything: SIGTERM to
each child (which drains), then SIGKILL after the drain time, so no orphan keeps a port or a model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from crossfill.config import ConfigError, CrossfillConfig, load_config

_GRACE_S = 10.0  # beyond the children's own drain time
_FIRST_BACKOFF_S = 0.5
_STABLE_S = 60.0  # a child that ran this long before dying starts again after the first backoff


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    ready_url: str | None
    start: Callable[[], subprocess.Popen[bytes]] | None = None  # how to start it again (None: cannot)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff_s: float = _FIRST_BACKOFF_S
    restart_at: float | None = None  # set while it is dead and waiting for its backoff
    rejoining: bool = False  # restarted, not yet seen ready


def _spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
    # A new session: the terminal's Ctrl-C reaches only `up`, which then stops children in order.
    return subprocess.Popen([sys.executable, *args], start_new_session=True, env={**os.environ,
                            "PYTHONUNBUFFERED": "1"})


def _spawn_master(address: str) -> subprocess.Popen[bytes]:
    from crossfill.kv.store.mooncake_master import find_master_binary

    host, _, port = address.rpartition(":")
    args = [str(find_master_binary()), f"--rpc_address={host}", f"--rpc_port={port}",
            "--enable_http_metadata_server=false", "--default_kv_lease_ttl=1000"]
    return subprocess.Popen(args, start_new_session=True, stdin=subprocess.DEVNULL)


def _mooncake_master(address: str) -> subprocess.Popen[bytes]:
    host, _, port = address.rpartition(":")
    proc = _spawn_master(address)
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
    # Secrets every process reads must exist before any starts (two creating them would disagree).
    from crossfill.security.paths import ensure_symmetric_keys, security_dir

    if cfg.security.tls.enabled:
        from crossfill.security.pki import init_security_dir

        written = init_security_dir(cfg)  # the CA and a certificate per service, where missing
        print(f"crossfill up: mutual TLS between services, certificates in {security_dir(cfg)}"
              f"{f' ({len(written)} files written)' if written else ''}; tools use operator.pem/.key",
              file=sys.stderr)
    else:
        ensure_symmetric_keys(security_dir(cfg))
    children: list[Child] = []

    def add(name: str, args: list[str], ready_url: str | None) -> None:
        children.append(Child(name, _spawn(name, args), ready_url, start=lambda: _spawn(name, args)))

    if cfg.crossings():
        add("links", ["-m", "crossfill.serving.links", config_path], None)
    kv = cfg.inference_service.kv_cache
    if kv.start_mooncake_master and kv.mooncake_master is not None:
        address = kv.mooncake_master
        try:
            children.append(Child("mooncake_master", _mooncake_master(address), None,
                                  start=lambda: _spawn_master(address)))
        except Exception:
            stop_children(children)  # the emulators already run: leave nothing behind
            raise
    order = sorted(cfg.instances(), key=lambda i: {"prefill": 0, "decode": 1, "scheduler": 2, "gateway": 3}[i.role])
    for inst in order:
        args = ["-m", "crossfill.cli", "serve", inst.role, "--config", config_path]
        if inst.role in ("prefill", "decode"):
            args += ["--instance", inst.name]
        add(inst.name, args, inst.url + "/readyz")
    return children


def stop_children(children: list[Child], grace_s: float = _GRACE_S) -> None:
    for c in reversed(children):
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        left = max(deadline - time.monotonic(), 0.1)
        try:
            c.proc.wait(left)
        except subprocess.TimeoutExpired:
            print(f"crossfill up: {c.name} did not stop in {grace_s:.0f}s, killing it", file=sys.stderr)
            c.proc.kill()
            c.proc.wait()


def probe_tls(cfg: CrossfillConfig) -> dict[str, Any]:
    """httpx arguments for readiness probes: the operator certificate under mutual TLS, else {}."""
    from crossfill.security.tls_http import operator_kwargs

    return operator_kwargs(cfg)


def wait_ready(children: list[Child], timeout_s: float, stopping: list[bool],
               tls: dict[str, Any] | None = None) -> str | None:
    """None when every child is ready; else why not (a child exited, timeout, or a signal).

    `tls`: httpx arguments for the probes (`probe_tls(cfg)`) when services run mutual TLS."""
    pending = {c.name: c for c in children if c.ready_url}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False, **(tls or {})) as client:
        while pending:
            if stopping[0]:
                return "interrupted"
            for c in children:
                if c.proc.poll() is not None:
                    return f"{c.name} exited with status {c.proc.returncode} during start-up"
            for name, c in list(pending.items()):
                if _is_ready(client, c):
                    print(f"crossfill up: {name} ready", file=sys.stderr)
                    del pending[name]
            if time.monotonic() > deadline:
                return f"not ready after {timeout_s:.0f}s: {', '.join(pending)}"
            time.sleep(0.3)
    return None


def _is_ready(client: httpx.Client, c: Child) -> bool:
    try:
        return client.get(c.ready_url, timeout=1.0).status_code == 200  # type: ignore[arg-type]
    except httpx.HTTPError:
        return False


def _exit_reason(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


class Supervisor:
    """Restarts children that die, with backoff; `tick()` is one pass of the watch loop."""

    def __init__(self, children: list[Child], backoff_max_s: float, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None, tls: dict[str, Any] | None = None) -> None:
        self.children = children
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.say = say or (lambda msg: print(f"crossfill up: {msg}", file=sys.stderr, flush=True))
        self.http = httpx.Client(timeout=1.0, trust_env=False, **(tls or {}))

    def tick(self) -> None:
        now = self.clock()
        for c in self.children:
            if c.restart_at is None and c.proc.poll() is not None:
                self._schedule(c, now)
            elif c.restart_at is not None and now >= c.restart_at:
                self._restart(c, now)
            elif c.rejoining and (c.ready_url is None or _is_ready(self.http, c)):
                c.rejoining = False
                self.say(f"{c.name} is back (restart {c.restarts})")

    def _schedule(self, c: Child, now: float) -> None:
        if c.start is None:
            self.say(f"{c.name} {_exit_reason(c.proc.returncode)}; it cannot be restarted")
            c.restart_at = float("inf")
            return
        if now - c.started_at >= _STABLE_S:
            c.backoff_s = _FIRST_BACKOFF_S
        c.restart_at = now + c.backoff_s
        self.say(f"{c.name} {_exit_reason(c.proc.returncode)}; restarting it in {c.backoff_s:g}s, the others "
                 "keep serving")
        c.backoff_s = min(c.backoff_s * 2, self.backoff_max_s)

    def _restart(self, c: Child, now: float) -> None:
        assert c.start is not None
        try:
            c.proc = c.start()
        except Exception as exc:  # noqa: BLE001 - e.g. the binary vanished: try again after the backoff
            self.say(f"cannot restart {c.name}: {exc}")
            c.restart_at = now + c.backoff_s
            return
        c.restart_at, c.started_at, c.rejoining = None, now, True
        c.restarts += 1

    def close(self) -> None:
        self.http.close()


def run_up(config_path: str) -> int:
    from crossfill.security.auth import apply_no_auth, startup_banner

    try:
        cfg = apply_no_auth(load_config(config_path))  # `--no-auth`: the children see CROSSFILL_NO_AUTH too
        auth_lines = startup_banner(cfg)  # refuses a config that turns keys on and defines none
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
    grace = cfg.serving.drain_timeout_s + _GRACE_S
    try:
        tls = probe_tls(cfg)
        why = wait_ready(children, cfg.serving.startup_timeout_s, stopping, tls)
        if why is not None:
            print(f"crossfill up: {why}; stopping everything", file=sys.stderr)
            return 0 if why == "interrupted" else 1
        gw = cfg.topology.gateway
        print(f"crossfill is up: OpenAI-compatible API at http://{gw.host}:{gw.port}/v1 "
              f"(model {cfg.model.api_name}); native POST /v1/generate; Ctrl-C stops everything.", flush=True)
        for line in auth_lines:
            print(f"crossfill up: {line}", flush=True)
        admin = next((k.key for k in cfg.security.auth.dev_keys if k.admin), None) if cfg.security.auth.enabled else None
        print(f"crossfill up: live dashboard at http://{gw.host}:{gw.port}/dashboard"
              + (f"?key={admin}" if admin else "") + "; `crossfill diagnose --config ...` checks the cluster",
              flush=True)
        sup = Supervisor(children, cfg.serving.restart_backoff_max_s, tls=tls)
        try:
            while not stopping[0]:
                sup.tick()
                time.sleep(0.2)
        finally:
            sup.close()
        return 0
    finally:
        stop_children(children, grace)
        print("crossfill up: stopped", file=sys.stderr)
