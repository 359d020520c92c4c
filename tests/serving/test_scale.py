"""Scale in and out at run time through the scheduler's admin API, under load, without dropping a request."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving_cluster import Cluster, free_port_block, launch_cluster
from serving_helpers import LONG, SHORT, generate

NEW = "here-decode-extra"


@pytest.fixture(scope="module")
def scaled(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str, str]]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("scale")) as c:
        s = c.cfg.topology.scheduler
        yield c, f"http://{s.host}:{s.port}", str(c.path)


def _until(what: str, predicate, timeout: float = 120.0) -> None:
    """Poll `predicate()` (an answer slower than its own timeout counts as False); the timeout is a safety net."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.TimeoutException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def _instances(sched: str) -> dict:
    return httpx.get(sched + "/v1/admin/instances", timeout=5).json()


def test_bad_scale_requests_are_refused_with_the_reason(scaled) -> None:
    _, sched, _ = scaled
    r = httpx.post(sched + "/v1/admin/instances", json={"name": "x", "role": "decode", "datacenter": "moon",
                                                         "host": "127.0.0.1", "port": 1, "kv_port": 2}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "datacenter"
    r = httpx.post(sched + "/v1/admin/instances", json={"name": "x", "role": "decode", "datacenter": "here",
                                                         "host": "127.0.0.1", "port": 1}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_port"
    r = httpx.post(sched + "/v1/admin/instances", json={"name": "here-decode-0", "role": "decode",
                                                         "datacenter": "here", "host": "127.0.0.1", "port": 1,
                                                         "kv_port": 2}, timeout=5)
    assert r.status_code == 409 and r.json()["error"]["code"] == "instance_exists"
    r = httpx.delete(sched + "/v1/admin/instances/here-decode-0", timeout=5)
    assert r.status_code == 409 and r.json()["error"]["code"] == "last_decode_instance"
    assert httpx.delete(sched + "/v1/admin/instances/nope", timeout=5).status_code == 404


def test_add_a_decode_instance_then_drain_the_old_one_under_load(scaled) -> None:
    cluster, sched, path = scaled
    base = free_port_block(2)
    proc = subprocess.Popen([sys.executable, "-m", "crossfill.cli", "serve", "decode", "--config", path,
                             "--instance", NEW, "--datacenter", "here", "--port", str(base),
                             "--kv-port", str(base + 1)], start_new_session=True)
    try:
        r = httpx.post(sched + "/v1/admin/instances", json={"name": NEW, "role": "decode", "datacenter": "here",
                                                             "host": "127.0.0.1", "port": base,
                                                             "kv_port": base + 1}, timeout=5)
        assert r.status_code == 200 and r.json()["added_at_run_time"], r.text
        _until("the new decode is ready in the scheduler",
               lambda: _instances(sched)[NEW]["ready"] and _instances(sched)[NEW]["healthy"])

        with cf.ThreadPoolExecutor(6) as pool:
            prompts = [LONG if i % 2 else SHORT for i in range(24)]
            futures = [pool.submit(generate, cluster.url, p, "auto", 16, ignore_eos=True, tenant_id=f"s{i}")
                       for i, p in enumerate(prompts)]
            # Scale in while requests are in flight: the old decode finishes its work, gets no more.
            _until("some requests started", lambda: any(f.done() for f in futures))
            r = httpx.delete(sched + "/v1/admin/instances/here-decode-0", timeout=5)
            assert r.status_code == 200 and r.json()["state"] in ("draining", "drained"), r.text
            answers = [f.result() for f in futures]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        served_by = {a.json()["crossfill"]["decode_instance"] for a in answers}
        assert NEW in served_by  # the added instance took traffic (remote prefill sent KV to it too)
        assert any(a.json()["crossfill"]["route"] == "remote" and a.json()["crossfill"]["decode_instance"] == NEW
                   for a in answers)
        _until("the old decode is drained", lambda: _instances(sched)["here-decode-0"]["state"] == "drained")
        after = [generate(cluster.url, SHORT, "auto", 4, tenant_id=f"after{i}") for i in range(3)]
        assert all(a.status_code == 200 and a.json()["crossfill"]["decode_instance"] == NEW for a in after)

        # Scale back: the configured decode takes traffic again, then the added one drains.
        r = httpx.post(sched + "/v1/admin/instances", json={"name": "here-decode-0", "role": "decode",
                                                             "datacenter": "here", "host": "127.0.0.1", "port": 1,
                                                             "kv_port": 2}, timeout=5)
        assert r.status_code == 200 and r.json()["state"] == "active"
        assert httpx.delete(sched + f"/v1/admin/instances/{NEW}", timeout=5).status_code == 200
        _until("the added decode is drained", lambda: _instances(sched)[NEW]["state"] == "drained")
        r = generate(cluster.url, LONG, "auto", 4, tenant_id="back")
        assert r.status_code == 200 and r.json()["crossfill"]["decode_instance"] == "here-decode-0"
    finally:
        proc.terminate()
        proc.wait(60)
