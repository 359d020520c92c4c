"""Multi-host rehearsal (issue 10 item 6): each datacenter in its own network namespace.

The same topology as serving_cluster.py — gateway, scheduler, local prefill and decode in "here",
a remote prefill in "far", the tiny random-weight model — but every process runs inside its
datacenter's Linux network namespace, bound to that namespace's address, and the datacenters
are joined by a veth pair the kernel shapes with `tc` (rate, plus delay where sch_netem exists).
The link says `emulate: false`, so no user-space emulator runs: the prefill request, the health
probes and the KV bytes cross real interfaces, whose kernel counters are checked against what
the route report says crossed. Skips, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest
import yaml
from serving_cluster import cluster_config
from serving_helpers import LONG, SHORT

from crossfill.config import CrossfillConfig, load_config
from crossfill.net import netns
from crossfill.serving.up import Child, stop_children, wait_ready

HERE_ADDR, FAR_ADDR = "10.77.0.1", "10.77.0.2"
RATE_MBIT, DELAY_MS = 200.0, 5.0
BASE_PORT = 8000  # fixed: each namespace is fresh, so nothing else can hold its ports
MAX_TOKENS = 12
# Bounds for events, not expectations: start-up imports torch in five processes on a loaded machine.
READY_TIMEOUT_S = 300.0


def _config(model_dir: Path) -> dict:
    doc = cluster_config(model_dir, BASE_PORT, network={"min_bandwidth_gbps": RATE_MBIT / 2000})
    topo = doc["topology"]
    topo["gateway"]["host"] = topo["scheduler"]["host"] = HERE_ADDR
    topo["datacenters"]["here"]["host"] = HERE_ADDR
    topo["datacenters"]["far"]["host"] = FAR_ADDR
    # What the kernel enforces, declared so the scheduler's link verdict matches it.
    topo["links"] = [{"between": ["far", "here"], "bandwidth_gbps": RATE_MBIT / 1000, "latency_ms": DELAY_MS,
                      "emulate": False}]
    return doc


def _start(cfg: CrossfillConfig, path: Path, namespace: dict[str, str], logs: Path, children: list[Child],
           files: list[IO[bytes]]) -> None:
    """Every instance as `ip netns exec NS python -m crossfill.cli serve ...`, in `crossfill up`'s order.

    Appends to the caller's lists as it goes, so whatever started is stopped even if a later start fails.
    """
    order = sorted(cfg.instances(), key=lambda i: {"prefill": 0, "decode": 1, "scheduler": 2, "gateway": 3}[i.role])
    for inst in order:
        argv = [sys.executable, "-m", "crossfill.cli", "serve", inst.role, "--config", str(path)]
        if inst.role in ("prefill", "decode"):
            argv += ["--instance", inst.name]
        out = (logs / f"{inst.name}.log").open("wb")
        files.append(out)
        proc = subprocess.Popen(netns.exec_argv(namespace[inst.datacenter], argv), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        children.append(Child(inst.name, proc, inst.url + "/readyz"))


def _log_tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in sorted(logs.glob("*.log")))


def _wait_all_healthy(scheduler_url: str) -> dict:
    """Until the scheduler's own probes (which cross the link for "far") saw every worker ready."""
    view: dict = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=5, trust_env=False) as http:
        while time.monotonic() < deadline:
            view = http.get(scheduler_url + "/v1/admin/cluster").json()
            if all(i["healthy"] and i["ready"] for i in view["instances"].values()):
                return view
            time.sleep(0.1)
    raise AssertionError(f"the scheduler never saw every instance healthy: {view}")


def _generate(url: str, prompt: str, policy: str) -> tuple[list[int], dict]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "prefill_policy": policy}
    with httpx.Client(timeout=300, trust_env=False) as http:
        r = http.post(url + "/v1/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"], r.json()["crossfill"]


@pytest.fixture
def wan() -> Iterator[netns.WanLink]:
    why = netns.unavailable_reason()
    if why is not None:
        pytest.skip(why)
    names = (f"cf{os.getpid()}-here", f"cf{os.getpid()}-far")
    with netns.joined_namespaces(names, (HERE_ADDR, FAR_ADDR), rate_mbit=RATE_MBIT, delay_ms=DELAY_MS) as link:
        yield link


def test_two_datacenters_in_namespaces_over_a_kernel_shaped_link(wan: netns.WanLink, tiny_llama_dir: Path,
                                                                 tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\n[netns] {wan.describe()}")
    here_ns, far_ns = wan.namespaces
    path = tmp_path / "netns.yaml"
    path.write_text(yaml.safe_dump(_config(tiny_llama_dir)))
    cfg = load_config(path)
    assert cfg.crossings() == []  # a real link: no emulator anywhere, instances reached directly
    assert cfg.kv_address("here-decode-0", "far") == (HERE_ADDR, BASE_PORT + 4)

    logs = tmp_path / "logs"
    logs.mkdir()
    gateway = f"http://{HERE_ADDR}:{BASE_PORT}"
    children: list[Child] = []
    files: list[IO[bytes]] = []
    # The client lives in "here", like a user next to the gateway; the host has no route to 10.77/16.
    client = netns.thread_in(here_ns)
    try:
        _start(cfg, path, {"here": here_ns, "far": far_ns}, logs, children, files)
        why = client.submit(wait_ready, children, READY_TIMEOUT_S, [False]).result()
        assert why is None, f"{why}\n{_log_tails(logs)}"
        client.submit(_wait_all_healthy, f"http://{HERE_ADDR}:{BASE_PORT + 1}").result()

        _, short = client.submit(_generate, gateway, SHORT, "auto").result()
        assert short["route"] == "local" and short["prefill_instance"] == "here-prefill-0", short

        here_rx0, _ = netns.interface_bytes(here_ns, wan.ifname)
        _, far_tx0 = netns.interface_bytes(far_ns, wan.ifname)
        remote_tokens, remote = client.submit(_generate, gateway, LONG, "auto").result()
        here_rx1, _ = netns.interface_bytes(here_ns, wan.ifname)
        _, far_tx1 = netns.interface_bytes(far_ns, wan.ifname)
        assert remote["route"] == "remote" and remote["prefill_instance"] == "far-prefill-0", remote
        assert remote["retries"] == 0 and remote["degradation_reason"] is None, remote
        assert remote["kv_wire_bytes"] > 0, remote
        # Health probes cross too, so the counters grow by more; never by less than the KV.
        assert far_tx1 - far_tx0 >= remote["kv_wire_bytes"], (far_tx1 - far_tx0, remote)
        assert here_rx1 - here_rx0 >= remote["kv_wire_bytes"], (here_rx1 - here_rx0, remote)
        assert netns.shaped_bytes(far_ns, wan.ifname) >= remote["kv_wire_bytes"]  # through the rate limit

        local_tokens, local = client.submit(_generate, gateway, LONG, "local_only").result()
        assert local["route"] == "local" and local["prefill_instance"] == "here-prefill-0", local
        assert remote_tokens == local_tokens and len(remote_tokens) == MAX_TOKENS
    finally:
        client.shutdown(wait=True)
        stop_children(children)
        for f in files:
            f.close()
