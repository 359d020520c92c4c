"""Prompts and small helpers shared by the serving tests."""

from __future__ import annotations

import time

import httpx

SHORT = "The quick brown fox"
# Well over the test cluster's long_context_threshold_tokens (64) with the tiny tokenizer.
LONG = "Prefill is compute bound; decode is memory bandwidth bound. " * 12


def generate(url: str, prompt: str, policy: str = "auto", max_tokens: int = 12, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "prefill_policy": policy, **extra}
    return httpx.post(url + "/v1/generate", json=body, timeout=60)


def wait_idle(cluster, names: list[str], timeout: float = 10.0) -> dict[str, dict]:
    """Poll GET /v1/admin/kv on each worker until no request is active and no block is in use."""
    deadline = time.monotonic() + timeout
    stats: dict[str, dict] = {}
    while time.monotonic() < deadline:
        stats = {n: cluster.kv(n) for n in names}
        if all(s["active_requests"] == 0 and s["blocks_used"] == 0 for s in stats.values()):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"KV not released: {stats}")


def arm(control_url: str, **fault: object) -> None:
    r = httpx.post(control_url + "/faults", json=fault, timeout=5)
    assert r.status_code == 200, r.text


def disarm(control_url: str) -> None:
    httpx.delete(control_url + "/faults", timeout=5)


def set_link(control_url: str, **settings: object) -> None:
    r = httpx.post(control_url + "/link", json=settings, timeout=5)
    assert r.status_code == 200, r.text
