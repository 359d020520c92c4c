"""A real two-datacenter cluster of processes on 127.0.0.1 with a tiny random-weight model.

Started with the same code `crossfill up` uses (one process per role plus the WAN emulators), so
tests can also kill and restart single instances. Ports are picked free at start.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from crossfill.config import CrossfillConfig, load_config
from crossfill.security.keys import client_api_key
from crossfill.security.paths import ensure_symmetric_keys
from crossfill.serving.up import Child, probe_tls, start_children, stop_children, wait_ready


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; the usual default)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports (checked by binding each).

    The block lies below the ephemeral range: there, any outgoing connection made while the
    cluster starts (its processes connect to each other) could take a port of the block before
    the process meant to listen on it binds, and that process would exit with "address in use".
    Mooncake TE's own listening ports (12001 and 15000-17000 in our runs) stay below 20000.
    """
    lo, _ = _ephemeral_ports()
    first, last = 20000, max(20000 + n, lo - n)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(first, last)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no block of {n} free ports in {first}..{last + n}")


# Server-side timeouts of the test clusters. cluster_config() keeps short ones (kv_cache.timeout_ms
# SHORT_KV_TIMEOUT_MS, an instance out of routing after two failed health checks): the tests of those
# timeouts launch a cluster with them, and so do harnesses built on cluster_config() itself. Every
# other cluster (launch_cluster, quiet_timeouts) gets timeouts that nothing a loaded machine does
# can trip by accident:
# - QUIET_KV_TIMEOUT_MS: the silence (no KV frame, no heartbeat from prefill) after which decode
#   gives up on an attempt; far longer than any delay of a busy machine and than any fault a test
#   holds on purpose (a stalled link the test itself ends), so no attempt fails unless a test says so.
# - HEALTH_CHECK_FAILURES: probes in a row (each may wait 2 s) that take an instance out of
#   routing; a killed instance still fails them within about a second (its port refuses at once).
QUIET_KV_TIMEOUT_MS = 20_000
SHORT_KV_TIMEOUT_MS = 1500
HEALTH_CHECK_FAILURES = 5


HARNESS_ADMIN_KEY = "harness-admin-key-0123456789"  # added by launch_cluster when auth is on and no admin key is


def quiet_timeouts(doc: dict) -> dict:
    """`doc` (from cluster_config) with the timeouts that no accident trips."""
    doc["inference_service"]["kv_cache"]["timeout_ms"] = QUIET_KV_TIMEOUT_MS
    doc["serving"]["health_check_failures"] = HEALTH_CHECK_FAILURES
    return doc


def _security_dir() -> str:
    """A fresh secrets folder with the ticket and KV keys already in it, as `crossfill up` leaves it:
    tests that build services in-process (without `up`) need them too."""
    d = tempfile.mkdtemp(prefix="crossfill-security-")
    ensure_symmetric_keys(Path(d))
    return d


def cluster_config(model_dir: Path, base: int, **overrides: object) -> dict:
    svc = {
        "mode": "prefill_decode_disaggregated",
        "routing": {"long_context_threshold_tokens": 64, "prefer_remote_prefill": True,
                    "fallback_to_local_on_failure": True},
        "prefill_pool": {"replicas": 1, "resource_class": "high_compute", "max_queue_depth": 4,
                         "warmup_before_serving": True},
        "decode_pool": {"replicas": 1, "resource_class": "high_bandwidth", "max_concurrent_requests": 8},
        "kv_cache": {"compression_enabled": True, "compression_mode": "hybrid_attention", "checksum_enabled": True,
                     "timeout_ms": SHORT_KV_TIMEOUT_MS, "max_retry": 1},
        # min_bandwidth_gbps far below the emulated 1 Gbit/s: on a loaded 2-core machine the
        # scheduler's bandwidth probe (Python on both ends, through a Python emulator) may measure
        # a third of that, and no test should lose the link to a busy CPU.
        "network": {"min_bandwidth_gbps": 0.05, "max_latency_ms": 50, "isolated_transport_queue": True},
        "observability": {"metrics_enabled": True, "tracing_enabled": True, "log_level": "info"},
    }
    for key, value in overrides.items():
        svc[key] = {**svc[key], **value} if isinstance(value, dict) else value  # type: ignore[dict-item]
    return {
        "inference_service": svc,
        "model": {"name": str(model_dir), "served_name": "tiny", "max_num_seqs": 8},
        "resource_classes": {"high_compute": {"torch_threads": 1, "kv_memory_mb": 16},
                             "high_bandwidth": {"torch_threads": 1, "kv_memory_mb": 16}},
        "serving": {"health_check_interval_ms": 200, "health_check_failures": 2, "startup_timeout_s": 120},
        # The tests of other concerns call every service directly with plain httpx and no API key, so
        # their clusters turn off the client-facing parts of security (tests/security runs the
        # defaults: keys, mutual TLS); tickets and KV encryption at rest stay on everywhere.
        "security": {"dir": _security_dir(), "audit_dir": None,
                     "auth": {"enabled": False}, "tls": {"enabled": False}},
        "topology": {
            "local_datacenter": "here",
            "gateway": {"port": base},
            "scheduler": {"port": base + 1},
            "datacenters": {
                "here": {"prefill": {"port": base + 2}, "decode": {"port": base + 3, "kv_port": base + 4}},
                "far": {"prefill": {"port": base + 5}},
            },
            "links": [{"between": ["far", "here"], "bandwidth_gbps": 1.0, "latency_ms": 5,
                       "emulator_port_base": base + 10}],
        },
    }


@dataclass
class Cluster:
    cfg: CrossfillConfig
    path: Path
    children: list[Child]

    @property
    def url(self) -> str:
        gw = self.cfg.topology.gateway
        return f"http://{gw.host}:{gw.port}"

    def worker_url(self, name: str) -> str:
        return self.cfg.instance(name).url  # https when the cluster runs mutual TLS

    @property
    def tls(self) -> dict:
        """httpx arguments for calling workers and the scheduler: the operator certificate under mutual TLS."""
        return probe_tls(self.cfg)

    @property
    def admin_headers(self) -> dict:
        """The scheduler's /v1/admin/* take an admin API key when security.auth is on (the first admin dev key)."""
        key = client_api_key(self.cfg, admin=True)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def emulator_control(self, target: str, kind: str) -> str:
        for c in self.cfg.crossings():
            if c.target == target and c.kind == kind:
                return f"http://{c.listen_host}:{c.control_port}"
        raise KeyError((target, kind))

    def kv(self, name: str) -> dict:
        return httpx.get(self.worker_url(name) + "/v1/admin/kv", timeout=5, **self.tls).json()

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def restart(self, name: str) -> None:
        """Start instance `name` again after a test killed it, and wait until it is ready."""
        inst = self.cfg.instance(name)
        old = self.child(name)
        args = [sys.executable, "-m", "crossfill.cli", "serve", inst.role, "--config", str(self.path),
                "--instance", name]
        new = Child(name, subprocess.Popen(args, start_new_session=True), inst.url + "/readyz")
        self.children[self.children.index(old)] = new
        assert wait_ready([new], 300, [False], self.tls) is None

    def wait_scheduler(self, predicate, timeout: float = 120.0) -> dict:
        """Poll the scheduler's cluster view until `predicate(view)` holds (the timeout is a safety net)."""
        deadline = time.monotonic() + timeout
        view: dict = {}
        while time.monotonic() < deadline:
            try:
                view = httpx.get(self.cfg.scheduler_url() + "/v1/admin/cluster", timeout=5, headers=self.admin_headers,
                                 **self.tls).json()
            except httpx.TimeoutException:  # a busy scheduler answers late: ask again
                continue
            if predicate(view):
                return view
            time.sleep(0.1)
        raise AssertionError(f"scheduler never reached the expected state: {view}")


@contextlib.contextmanager
def launch_cluster(model: str, tmp_dir: Path, served_name: str = "tiny", kv_memory_mb: int = 16,
                   model_overrides: dict | None = None, decode_kv_memory_mb: int | None = None,
                   edit: Callable[[dict], None] | None = None, **overrides: object) -> Iterator[Cluster]:
    """Start a whole cluster (same code path as `crossfill up`), yield it, stop every process.

    Its timeouts are the quiet ones (see QUIET_KV_TIMEOUT_MS) unless a `kv_cache` override sets timeout_ms."""
    base = free_port_block(120)
    overrides["kv_cache"] = {"timeout_ms": QUIET_KV_TIMEOUT_MS, **overrides.get("kv_cache", {})}  # type: ignore[dict-item]
    doc = cluster_config(Path(model), base, **overrides)
    doc["serving"]["health_check_failures"] = HEALTH_CHECK_FAILURES
    doc["model"] = {"name": model, "served_name": served_name, "max_num_seqs": 8, **(model_overrides or {})}
    for rc in doc["resource_classes"].values():
        rc["kv_memory_mb"] = kv_memory_mb
    if decode_kv_memory_mb is not None:
        doc["resource_classes"]["high_bandwidth"]["kv_memory_mb"] = decode_kv_memory_mb
    if edit is not None:
        edit(doc)  # anything else about the cluster, e.g. its topology
    auth = doc["security"]["auth"]
    if auth.get("enabled", True) and not any(k.get("admin") for k in auth.get("dev_keys", [])):
        # The harness watches the scheduler's /v1/admin/cluster: with API keys on it needs an admin key.
        auth["dev_keys"] = [*auth.get("dev_keys", []), {"key": HARNESS_ADMIN_KEY, "tenant": "harness", "admin": True}]
    path = tmp_dir / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_config(path)
    children = start_children(cfg, str(path))
    try:
        why = wait_ready(children, 300, [False], probe_tls(cfg))
        assert why is None, why
        c = Cluster(cfg, path, children)
        # Remote instances are reached through the emulator: wait until the scheduler saw all healthy.
        c.wait_scheduler(lambda v: all(i["healthy"] and i["ready"] for i in v["instances"].values()))
        yield c
    finally:
        stop_children(children)


@pytest.fixture(scope="session")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("cluster")) as c:
        yield c
