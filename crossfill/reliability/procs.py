"""The `crossfill up` process the harness starts, and its children (found with psutil by command line).

`up` supervises: a child that dies is started again and rejoins by itself, so the harness only
kills (kill -9 = a crash, SIGTERM = a graceful drain) and then waits for the replacement — a new
pid under `up` — and for whatever readiness the scenario needs (see `cluster.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

UP_LINE = "crossfill is up:"


def child_name(cmdline: list[str]) -> str | None:
    """Which process of the deployment a command line is: an instance name, 'scheduler', 'gateway',
    'links' or 'mooncake_master'."""
    if "crossfill.serving.links" in cmdline:
        return "links"
    if cmdline and "mooncake_master" in Path(cmdline[0]).name:
        return "mooncake_master"
    if "serve" in cmdline:
        if "--instance" in cmdline:
            i = cmdline.index("--instance")
            return cmdline[i + 1] if i + 1 < len(cmdline) else None
        for arg in cmdline[cmdline.index("serve") + 1:]:
            if arg.startswith("--instance="):
                return arg.split("=", 1)[1]
        role = cmdline[cmdline.index("serve") + 1] if cmdline.index("serve") + 1 < len(cmdline) else None
        return role if role in ("scheduler", "gateway") else None
    return None


class ClusterDidNotStart(RuntimeError):
    """`crossfill up` exited or timed out before the cluster was up; the message ends with its log's tail."""


class UpProcess:
    """`crossfill up --config FILE` as a subprocess; its stderr (and the children's) goes to `log_path`."""

    def __init__(self, config_path: str | Path, log_path: Path) -> None:
        self.config_path = str(config_path)
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self._up = threading.Event()
        # Every child seen: stop() makes sure none survives. psutil refuses to signal a Process whose
        # pid was reused since, so this only ever reaches processes this harness started (through up).
        self._known: dict[int, psutil.Process] = {}

    async def start(self, timeout_s: float) -> None:
        """Start `up` and return once it printed that the cluster is up; raise with the log's tail if not."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "crossfill.cli", "up", "--config", self.config_path],
            stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        # The children inherit up's stdout: keep draining it so a chatty child never blocks on a full pipe.
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self._up.is_set():
            if self.proc.poll() is not None:
                raise ClusterDidNotStart(f"crossfill up exited with status {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterDidNotStart(f"crossfill up was not up within {timeout_s:.0f}s:\n{self.log_tail()}")
            await asyncio.sleep(0.2)

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.with_suffix(".stdout.log").open("a") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                if line.startswith(UP_LINE):
                    self._up.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> dict[str, psutil.Process]:
        """The running children by name (a child that just died, a zombie until reaped, is left out)."""
        out: dict[str, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children():
                try:
                    if child.status() == psutil.STATUS_ZOMBIE:
                        continue
                    name = child_name(child.cmdline())
                except psutil.Error:
                    continue
                if name is not None:
                    out[name] = child
                    self._known.setdefault(child.pid, child)
        return out

    def pid_of(self, name: str) -> int | None:
        child = self.children().get(name)
        return child.pid if child is not None else None

    def signal(self, name: str, sig: int) -> int:
        """Send `sig` to child `name`; return its pid."""
        child = self.children().get(name)
        if child is None:
            raise RuntimeError(f"no running child named {name!r} under crossfill up (pid {self.pid})")
        child.send_signal(sig)
        return child.pid

    def kill9(self, name: str) -> int:
        return self.signal(name, signal.SIGKILL)

    def terminate(self, name: str) -> int:
        return self.signal(name, signal.SIGTERM)

    def replaced(self, name: str, old_pid: int) -> bool:
        """A new process runs `name` (the supervisor restarted it)."""
        pid = self.pid_of(name)
        return pid is not None and pid != old_pid

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace_s: float) -> None:
        """SIGTERM to `up` (which drains and stops its children); SIGKILL whatever remains after `grace_s`."""
        if self.proc is None:
            return
        self.children()  # remember the current pids
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in self._known.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
