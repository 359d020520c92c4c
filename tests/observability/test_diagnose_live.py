"""`crossfill diagnose --config` on a live cluster: nothing on a healthy one, then four M8 symptoms.

One cluster with API keys on, so diagnose reads the scheduler's admin API with the config's admin
dev key. Mutual TLS is off in this cluster: under TLS a corrupted byte on the KV link lands in a
TLS handshake or record and the connection is simply made again, so the KV frame checks this test
wants to see fail never see the damage (test_grafana_live.py scrapes a cluster under mutual TLS
with the operator certificate, the way diagnose reads one). Small pools (prefill max_queue_depth 2, decode max_concurrent_requests 2)
so a little load fills them. Symptoms are provoked with the link emulator's control API and load:

- corruption on the KV link: a remote request's transfer fails and is retried -> kv_transfer_failures;
- a stalled KV link with two remote requests held in it: far prefill's queue and decode are full,
  a third request is refused 429 decode_full -> prefill_backlog and decode_full;
- latency on the link well above network.max_latency_ms -> the scheduler's monitor marks it
  unusable -> link_slow.

Counter symptoms are judged against a snapshot saved just before the fault (`--save`/`--baseline`),
and each check polls diagnose until the finding appears (a bounded number of tries), never a
fixed wait.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving.serving_cluster import Cluster, launch_cluster
from serving.serving_helpers import FOREVER_MS, SHORT, arm, heal, set_link, unique_long, wait_until

pytestmark = pytest.mark.timeout(600)

KEY = "diagnose-test-admin-key-0123456789"
KV_LINK = ("here-decode-0", "kv")  # far prefill -> decode's KV port, through the emulator
HTTP_LINK = ("far-prefill-0", "http")  # the local DC -> far prefill's HTTP port, through the emulator


def _keys_on(doc: dict) -> None:
    doc["security"]["auth"] = {"enabled": True, "dev_keys": [{"key": KEY, "tenant": "ops", "admin": True}]}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("diagnose"), edit=_keys_on,
                        prefill_pool={"max_queue_depth": 2},
                        decode_pool={"max_concurrent_requests": 2}) as c:
        yield c


def _generate(c: Cluster, prompt: str, policy: str, max_tokens: int = 4) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "prefill_policy": policy}
    return httpx.post(c.url + "/v1/generate", json=body, timeout=300, headers={"Authorization": f"Bearer {KEY}"})


def _corrupted_bytes(control: str) -> int:
    return int(httpx.get(control + "/link", timeout=5).json()["counters"]["up"]["corrupted_bytes"])


def _stats(c: Cluster, name: str) -> dict:
    return httpx.get(c.worker_url(name) + "/v1/admin/stats", timeout=5, **c.tls).json()


def _diagnose_args(c: Cluster, *args: str) -> list[str]:
    return [sys.executable, "-m", "crossfill.cli", "diagnose", "--config", str(c.path), *args]


def _findings(c: Cluster, *args: str) -> dict[str, list[str]]:
    """rule id -> evidence, from `crossfill diagnose --json` (exit status 1 exactly when it found something)."""
    p = subprocess.run(_diagnose_args(c, "--json", *args), capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr
    found = {f["rule"]: f["evidence"] for f in json.loads(p.stdout)["findings"]}
    assert (p.returncode == 1) == bool(found)
    return found


def _poll(c: Cluster, rules: set[str], *args: str, tries: int = 60) -> dict[str, list[str]]:
    """Run diagnose until it names every rule in `rules` (each try reads the whole cluster)."""
    found: dict[str, list[str]] = {}
    for _ in range(tries):
        found = _findings(c, *args)
        if rules <= set(found):
            return found
    raise AssertionError(f"diagnose never named {sorted(rules - set(found))}; it said {found}")


def test_diagnose_names_nothing_on_a_healthy_cluster_then_each_provoked_symptom(cluster: Cluster,
                                                                                tmp_path: Path) -> None:
    c = cluster
    # -- healthy: local and remote traffic, two readings --window apart, nothing to say.
    with subprocess.Popen(_diagnose_args(c, "--window", "3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as p:
        for prompt, policy in ((SHORT, "auto"), (unique_long(), "remote_required"), (unique_long(), "auto")):
            r = _generate(c, prompt, policy)
            assert r.status_code == 200, r.text
        out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert "read 5 of 5 services" in out and "no findings" in out, out
    # With only the gateway's address it reads the gateway's metrics, and says how little that is.
    p2 = subprocess.run([sys.executable, "-m", "crossfill.cli", "diagnose", "--url", c.url, "--window", "0"],
                        capture_output=True, text=True, timeout=120)
    assert p2.returncode == 0 and "read 1 of 1 services (no scheduler view" in p2.stdout, p2.stdout + p2.stderr

    # -- corruption on the KV link: decode refuses the damaged frame, prefill sends it again.
    base = tmp_path / "before-corruption.json"
    _findings(c, "--window", "0", "--save", str(base))
    control = c.emulator_control(*KV_LINK)
    corrupted = _corrupted_bytes(control)
    arm(control, corrupt_bytes=64)
    try:
        r = _generate(c, unique_long(), "remote_required")
    finally:
        heal(control)
    assert r.status_code == 200, r.text  # the transport recovered: only the counters tell
    assert _corrupted_bytes(control) - corrupted == 64  # the fault really hit this request's KV
    found = _poll(c, {"kv_transfer_failures"}, "--baseline", str(base))
    assert any("retransmitted" in e for e in found["kv_transfer_failures"]), found

    # -- a stalled KV link holds two remote requests: far prefill (2/2) and decode (2/2) are full.
    base = tmp_path / "before-stall.json"
    _findings(c, "--window", "0", "--save", str(base))
    arm(control, stall_ms=FOREVER_MS)
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_generate, c, unique_long(), "remote_required") for _ in range(2)]
            wait_until("decode holds both requests", lambda: _stats(c, "here-decode-0")["queue_depth"] >= 2)
            refused = _generate(c, unique_long(), "remote_required")
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "decode_full", refused.text
            found = _poll(c, {"prefill_backlog", "decode_full"}, "--baseline", str(base))
            heal(control)
            assert all(f.result().status_code == 200 for f in held)
    finally:
        heal(control)
    assert any("far-prefill-0 queue 2/2" in e for e in found["prefill_backlog"]), found
    assert any("refused with decode_full" in e for e in found["decode_full"]), found

    # -- the link slows down (150 ms one way, max_latency_ms is 50): the scheduler stops using it.
    controls = [c.emulator_control(*KV_LINK), c.emulator_control(*HTTP_LINK)]
    for ctl in controls:
        set_link(ctl, latency=150)
    try:
        found = _poll(c, {"link_slow"}, "--window", "0")
    finally:
        for ctl in controls:
            set_link(ctl, latency=5)
    assert any(e.startswith("link far:") for e in found["link_slow"]), found
