"""Readiness and refusals of single services, in-process with real apps (no cluster needed)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from serving_cluster import cluster_config, free_port_block

from crossfill.config import parse_config
from crossfill.serving.prefill_worker import PrefillWorker, create_prefill_app
from crossfill.serving.scheduler import create_scheduler_app


def _until(what: str, predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_prefill_not_ready_until_loaded_and_warmed(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config(cluster_config(tiny_llama_dir, free_port_block(120)))
    # The model loads only when the test says so: what a client sees while it loads does not
    # depend on how fast this machine loads it.
    may_load = threading.Event()
    load = PrefillWorker._load_engine

    def held_load(self):
        assert may_load.wait(120), "the test never let the model load"
        return load(self)

    monkeypatch.setattr(PrefillWorker, "_load_engine", held_load)
    app = create_prefill_app(cfg, cfg.instance("here-prefill-0"))
    reasons = []
    with TestClient(app) as client:
        assert client.get("/healthz").json()["status"] == "ok"  # alive while loading
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "loading model"
        # Not ready: prefill work is refused with a clear 503 and Retry-After, not queued.
        refused = client.post("/v1/prefill", json={
            "request_id": "r", "cache_id": "c", "prompt_token_ids": [5, 6], "sampling": {}, "kv_host": "127.0.0.1",
            "kv_port": 9, "decode_instance": "here-decode-0"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        may_load.set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = client.get("/readyz")
            reasons.append(r.json()["reason"])
            if r.status_code == 200:
                break
            assert r.status_code == 503 and reasons[-1] in ("loading model", "warming up"), reasons
            time.sleep(0.01)
        assert reasons[-1] == "ready"
        kv = client.get("/v1/admin/kv").json()
        assert kv["active_requests"] == 0 and kv["blocks_used"] == 0 and kv["blocks_total"] > 0


def test_scheduler_without_workers_is_not_ready_and_refuses_clearly(tiny_llama_dir: Path) -> None:
    cfg = parse_config(cluster_config(tiny_llama_dir, free_port_block(120)))
    with TestClient(create_scheduler_app(cfg)) as client:
        # Its first probe round has answered (every worker refused): it knows there is no decode.
        _until("the scheduler's first probe round", lambda: client.get("/v1/admin/cluster").json()["probe_rounds"] >= 1)
        r = client.get("/readyz")
        assert r.status_code == 503 and "decode" in r.json()["reason"]
        r = client.post("/v1/route", json={"request_id": "x", "prompt_tokens": 5})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_decode_instance"
        r = client.post("/v1/route", json={"request_id": "x", "prompt_tokens": "many"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_tokens"
        view = client.get("/v1/admin/cluster").json()
        assert not view["instances"]["far-prefill-0"]["healthy"]
        assert view["instances"]["far-prefill-0"]["last_error"]
