"""Prompts and small helpers shared by the serving tests."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx

SHORT = "The quick brown fox"
# Well over the test cluster's long_context_threshold_tokens (64) with the tiny tokenizer.
LONG = "Prefill is compute bound; decode is memory bandwidth bound. " * 12


def unique_long() -> str:
    """LONG with a first block no cache holds: under `auto`, a prompt decode or local prefill has
    seen before is cheap to serve locally (cache-aware routing), so a test of length-based routing
    needs a prompt nobody has cached."""
    return f"Request {uuid.uuid4().hex}: " + LONG


# A stall no test waits out: the test ends it (heal) once it saw what it waited for.
FOREVER_MS = 600_000


def generate(url: str, prompt: str, policy: str = "auto", max_tokens: int = 12, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "prefill_policy": policy, **extra}
    return httpx.post(url + "/v1/generate", json=body, timeout=60)


def wait_until(what: str, predicate, timeout: float = 120.0) -> None:
    """Poll `predicate()` until it holds; the timeout is only a safety net against a hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def wait_idle(cluster, names: list[str], timeout: float = 60.0) -> dict[str, dict]:
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


def heal(control_url: str) -> None:
    """End a stall or partition the test armed: what it held moves on at once (DELETE /faults)."""
    disarm(control_url)


def set_link(control_url: str, **settings: object) -> None:
    r = httpx.post(control_url + "/link", json=settings, timeout=5)
    assert r.status_code == 200, r.text


def counter(url: str, name: str, **client: object) -> float:
    """The value of a Prometheus counter without labels on `url`/metrics (0 before its first increment).

    `client`: httpx arguments, e.g. `cluster.tls` for a worker of a cluster under mutual TLS."""
    text = httpx.get(url + "/metrics", timeout=5, **client).text  # type: ignore[arg-type]
    m = re.search(rf"^{name}_total (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@contextlib.contextmanager
def request_left_open(url: str, body: dict, path: str = "/v1/generate") -> Iterator[socket.socket]:
    """POST `body` on a raw connection and keep it open; leaving the block closes it.

    A client that goes away at the moment the test chooses, after an event it waited for, where a
    short client timeout would race with the server's answer.
    """
    where = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((where.hostname, where.port), timeout=30) as s:
        s.sendall(head + data)
        yield s


def transfer_ticket(cfg, request_id: str, *, decode: str = "here-decode-0", prefills: tuple[str, ...] = ("far-prefill-0",),
                    tenant: str = "", ttl_s: float | None = None) -> str:
    """A transfer ticket signed with the cluster's own keys, as its scheduler signs one: for tests
    that post a PrefillJob or a DecodeJob to a worker themselves (crossfill.security.tickets)."""
    from crossfill.security.paths import ticket_keys_path
    from crossfill.security.tickets import TicketKeys, TicketSigner

    signer = TicketSigner(TicketKeys(ticket_keys_path(cfg)), cfg.security.tickets.ttl_s if ttl_s is None else ttl_s)
    return signer.sign(request_id=request_id, tenant=tenant, decode=decode, prefills=prefills)
