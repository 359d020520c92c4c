"""`crossfill up` as a process manager: one dead process never takes the cluster down.

The real `crossfill up` runs the tiny two-DC cluster; the tests kill -9 or SIGTERM single
processes under load and check what a user relies on: every request ends with a result or a JSON
error, `up` restarts the process and it rejoins by itself, drained processes finish their work.
Everything waits for events (readiness, the scheduler's view, stats), never for a fixed time.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from serving_cluster import cluster_config, free_port_block, quiet_timeouts
from serving_helpers import FOREVER_MS, LONG, arm, generate, heal

from crossfill.config import CrossfillConfig, load_config

FAR = "far-prefill-0"
DECODE = "here-decode-0"


@dataclass
class Up:
    proc: subprocess.Popen[str]
    cfg: CrossfillConfig
    log: Path

    @property
    def url(self) -> str:
        gw = self.cfg.topology.gateway
        return f"http://{gw.host}:{gw.port}"

    def pid_of(self, name: str) -> int | None:
        """The pid of `up`'s child running `name` (an instance name, `scheduler` or `gateway`), if any now."""
        for child in psutil.Process(self.proc.pid).children():
            try:
                cmd = child.cmdline()
            except psutil.Error:  # exited (a zombie until `up` reaps it)
                continue
            if (f"--instance={name}" in cmd or (name in cmd and "--instance" in cmd)
                    or (name in ("scheduler", "gateway") and "serve" in cmd and name in cmd)):
                return child.pid
        return None

    def scheduler_view(self) -> dict:
        s = self.cfg.topology.scheduler
        return httpx.get(f"http://{s.host}:{s.port}/v1/admin/cluster", timeout=5).json()

    def wait_for(self, what: str, predicate, timeout: float = 120.0) -> None:
        """Poll `predicate()` (exceptions count as False) until it holds; the timeout is only a safety net."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"crossfill up exited ({self.proc.returncode}): {self.log.read_text()}"
            try:
                if predicate():
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"never happened: {what}\n{self.log.read_text()[-3000:]}")

    def stats(self, name: str) -> dict:
        return httpx.get(self.cfg.instance(name).url + "/v1/admin/stats", timeout=5).json()


@pytest.fixture(scope="module")
def up(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up")
    base = free_port_block(120)
    # kv_cache.timeout_ms far longer than any stall a test holds: a request held in flight stays
    # held until the test releases it (see serving_cluster.QUIET_KV_TIMEOUT_MS).
    doc = quiet_timeouts(cluster_config(tiny_llama_dir, base))
    doc["serving"].update(drain_timeout_s=60, retry_budget_s=120)
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    log = tmp / "up.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "crossfill.cli", "up", "--config", str(path)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    u = Up(proc, load_config(path), log)
    try:
        assert proc.stdout is not None
        assert "crossfill is up" in proc.stdout.readline(), log.read_text()
        u.wait_for("every instance healthy in the scheduler",
                   lambda: all(i["healthy"] and i["ready"] for i in u.scheduler_view()["instances"].values()))
        yield u
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def _remote_healthy(u: Up) -> bool:
    """The remote prefill is back in routing: healthy, ready, and its link usable (failed transfers
    open the link's circuit breaker, which closes after its cooldown and successful probes)."""
    view = u.scheduler_view()
    inst = view["instances"][FAR]
    link = view["links"][inst["datacenter"]]
    return inst["healthy"] and inst["ready"] and link["usable"]


def test_kill_9_of_the_remote_prefill_mid_transfer_loses_nothing(up: Up) -> None:
    control = next(f"http://{c.listen_host}:{c.control_port}" for c in up.cfg.crossings()
                   if c.target == DECODE and c.kind == "kv")
    # Hold every KV transfer on the WAN so the kill lands mid-transfer, whatever the machine's speed.
    arm(control, stall_ms=FOREVER_MS)
    old_pid = up.pid_of(FAR)
    assert old_pid is not None
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(generate, up.url, LONG, "remote_preferred", 8, ignore_eos=True,
                                   tenant_id=f"kill-{i}") for i in range(4)]
            up.wait_for("the remote prefill holds requests", lambda: up.stats(FAR)["queue_depth"] > 0)
            psutil.Process(old_pid).kill()
            answers = [f.result() for f in futures]
    finally:
        heal(control)
    for r in answers:
        assert r.headers["content-type"].startswith("application/json"), r.text
        if r.status_code == 200:
            # Served by the local prefill instead, and the answer says so.
            info = r.json()["crossfill"]
            assert info["prefill_instance"] != FAR and info["degradation_reason"], info
        else:
            assert r.json()["error"]["code"], r.text
    assert sum(r.status_code == 200 for r in answers) >= 1
    # `up` is still running, restarted the prefill, and the scheduler routes remote again.
    up.wait_for("the remote prefill restarted", lambda: up.pid_of(FAR) not in (None, old_pid))
    up.wait_for("the restarted prefill is ready", lambda: up.stats(FAR)["ready"])
    up.wait_for("the scheduler takes the restarted prefill back", lambda: _remote_healthy(up))
    r = generate(up.url, LONG, "remote_required", 8, tenant_id="after-restart")
    assert r.status_code == 200 and r.json()["crossfill"]["prefill_instance"] == FAR, r.text
    assert "far-prefill-0 killed by SIGKILL; restarting it" in up.log.read_text()


def test_sigterm_drains_the_gateway_and_up_restarts_it(up: Up) -> None:
    control = next(f"http://{c.listen_host}:{c.control_port}" for c in up.cfg.crossings()
                   if c.target == DECODE and c.kind == "kv")
    old_pid = up.pid_of("gateway")
    assert old_pid is not None
    arm(control, stall_ms=FOREVER_MS)  # a request held in flight while the gateway is told to stop
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(generate, up.url, LONG, "remote_required", 8, tenant_id="drain")
            up.wait_for("the request reached the remote prefill", lambda: up.stats(FAR)["queue_depth"] > 0)
            psutil.Process(old_pid).send_signal(signal.SIGTERM)
            # The old gateway drains (not ready) and waits for the request it holds...
            up.wait_for("the gateway drains", lambda: httpx.get(up.url + "/readyz", timeout=5).status_code == 503)
            heal(control)  # ... which can finish now
            r = fut.result()
    finally:
        heal(control)
    assert r.status_code == 200, r.text  # drained: the request in flight finished
    up.wait_for("a new gateway", lambda: up.pid_of("gateway") not in (None, old_pid))
    up.wait_for("the new gateway is ready", lambda: httpx.get(up.url + "/readyz", timeout=2).status_code == 200)
    assert generate(up.url, LONG, "auto", 4).status_code == 200


def test_a_request_survives_the_decode_worker_dying_before_its_first_token(up: Up) -> None:
    """kill -9 of the only decode instance: not-yet-answered requests are routed again once it is back."""
    control = next(f"http://{c.listen_host}:{c.control_port}" for c in up.cfg.crossings()
                   if c.target == DECODE and c.kind == "kv")
    old_pid = up.pid_of(DECODE)
    assert old_pid is not None
    arm(control, stall_ms=FOREVER_MS)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(generate, up.url, LONG, "remote_preferred", 8, ignore_eos=True, tenant_id="dec")
            up.wait_for("the request is waiting for its KV", lambda: up.stats(DECODE)["queue_depth"] > 0)
            psutil.Process(old_pid).kill()
            psutil.Process(old_pid).wait(30)
            heal(control)  # the rescheduled try must be able to get its KV
            r = fut.result()
    finally:
        heal(control)
    assert r.status_code == 200, r.text
    info = r.json()["crossfill"]
    assert "rescheduled after decode here-decode-0" in info["degradation_reason"], info
    assert up.pid_of(DECODE) not in (None, old_pid)


def _gateway_counter(up: Up, line_prefix: str) -> float:
    for line in httpx.get(up.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_silent_decode_is_detected_and_the_request_rescheduled(up: Up) -> None:
    """SIGSTOP (a hung decode keeps its connections open): the gateway notices by health checks, not a deadline."""
    silent = 'crossfill_errors_total{code="decode_silent"}'
    before = _gateway_counter(up, silent)
    control = next(f"http://{c.listen_host}:{c.control_port}" for c in up.cfg.crossings()
                   if c.target == DECODE and c.kind == "kv")
    pid = up.pid_of(DECODE)
    assert pid is not None
    arm(control, stall_ms=FOREVER_MS)
    stopped = False
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(generate, up.url, LONG, "remote_preferred", 8, ignore_eos=True, tenant_id="silent")
            up.wait_for("the request is waiting for its KV", lambda: up.stats(DECODE)["queue_depth"] > 0)
            psutil.Process(pid).suspend()
            stopped = True
            up.wait_for("the gateway declares decode silent", lambda: _gateway_counter(up, silent) > before)
            heal(control)
            psutil.Process(pid).resume()
            stopped = False
            r = fut.result()
    finally:
        if stopped:
            psutil.Process(pid).resume()
        heal(control)
    assert r.status_code == 200, r.text
    assert "stopped answering" in r.json()["crossfill"]["degradation_reason"]
