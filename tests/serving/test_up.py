"""`crossfill up` as a user runs it: starts every role, prints where the API is, stops cleanly on Ctrl-C.

It runs a colocated-mode deployment with metrics and tracing switched off, so the same start also
checks that those seed keys take effect.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml
from serving_cluster import cluster_config, free_port_block
from serving_helpers import SHORT, generate


def test_up_serves_and_stops_cleanly_on_ctrl_c(tiny_llama_dir: Path, tmp_path: Path) -> None:
    base = free_port_block(120)
    doc = cluster_config(tiny_llama_dir, base, mode="colocated",
                         observability={"metrics_enabled": False, "tracing_enabled": False, "log_level": "warning"})
    doc["topology"]["datacenters"] = {"here": {"decode": {"port": base + 3, "kv_port": base + 4}}}
    doc["topology"]["links"] = []
    path = tmp_path / "colocated.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen([sys.executable, "-m", "crossfill.cli", "up", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{base}"
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until every role is ready
        assert f"API at {url}/v1" in line, line

        r = generate(url, SHORT)
        assert r.status_code == 200, r.text
        info = r.json()["crossfill"]
        assert info["route"] == "local" and info["prefill_instance"] == info["decode_instance"] == "here-decode-0"
        assert info["trace_id"] is None  # tracing_enabled: false
        r = generate(url, SHORT, "remote_required")
        assert r.status_code == 503 and "colocated" in r.json()["error"]["message"]
        assert httpx.get(url + "/metrics", timeout=5).status_code == 404  # metrics_enabled: false

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # Every role's process is gone: nothing answers on any of its ports.
    for port in (base, base + 1, base + 3):
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            raise AssertionError(f"port {port} still answers after crossfill up stopped")
        except httpx.ConnectError:
            pass



def test_serve_with_an_unknown_instance_names_the_known_ones() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "crossfill.cli", "serve", "prefill", "--config",
                          str(root / "examples/two-dc.yaml"), "--instance", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "no instance named 'nope'" in out.stdout and "dc-remote-prefill-0" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
