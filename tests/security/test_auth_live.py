"""API keys, admin keys, audit and abuse limits on a real cluster with `security.auth` on.

One cluster (the processes `crossfill up` starts) with dev keys for three tenants and an admin, the
audit log on, a one-stream limit for the tenant "streamer", and a small body size and body timeout.
The official `openai` client checks what an OpenAI client sees (AuthenticationError, 403, 429 with
Retry-After); raw sockets play the clients no library would be (a stalled body).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from serving.serving_cluster import Cluster, launch_cluster
from serving.serving_helpers import FOREVER_MS, LONG, SHORT, arm, heal, wait_idle, wait_until

from crossfill.security.keys import hash_key, key_id

pytestmark = pytest.mark.timeout(600)

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef"
STREAMER = "streamer-key-0123456789abcdef"
ADMIN = "admin-key-0123456789abcdef"
WRONG = "cf-not-a-key-of-this-cluster-0123"
MAX_BODY = 16 * 1024
BODY_TIMEOUT_S = 4.0  # small, so the stalled-body test is quick; a whole body in one write is far faster
WORKERS = ["here-prefill-0", "here-decode-0", "far-prefill-0"]


def _auth_on(audit_dir: Path):
    def edit(doc: dict) -> None:
        doc["security"]["auth"].update(enabled=True, dev_keys=[
            {"key": ALICE, "tenant": "alice"}, {"key": BOB, "tenant": "bob"},
            {"key": STREAMER, "tenant": "streamer"}, {"key": ADMIN, "tenant": "ops", "admin": True}])
        doc["security"]["audit_dir"] = str(audit_dir)
        doc["security"]["limits"] = {"tenants": {"streamer": {"max_concurrent_streams": 1}},
                                     "max_body_bytes": MAX_BODY, "client_body_timeout_s": BODY_TIMEOUT_S}
    return edit


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("auth-live")
    with launch_cluster(str(tiny_llama_dir), tmp, edit=_auth_on(tmp / "audit")) as c:
        yield c


def _client(c: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _audit(c: Cluster, service: str) -> list[dict]:
    path = Path(c.cfg.security.audit_dir or "") / f"{service}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _scheduler(c: Cluster) -> str:
    return c.cfg.scheduler_url()


def test_no_key_or_a_wrong_key_is_a_401_an_openai_client_understands(keyed: Cluster) -> None:
    with pytest.raises(openai.AuthenticationError) as exc:
        _client(keyed, WRONG).completions.create(model="tiny", prompt=SHORT, max_tokens=2)
    err = exc.value.body
    assert exc.value.status_code == 401 and err["code"] == "invalid_api_key", err
    assert err["type"] == "invalid_request_error"
    assert exc.value.response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, WRONG).models.list()  # listing models needs a key too
    # No key at all (the openai client refuses to send none, so plain httpx).
    r = httpx.post(keyed.url + "/v1/generate", json={"prompt": SHORT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    # Recorded by its public key_id, address and path; never the key itself.
    failed = [r for r in _audit(keyed, "gateway") if r["event"] == "auth_failed"]
    assert any(r["key_id"] == key_id(hash_key(WRONG)) and r["path"] == "/v1/completions" for r in failed)
    assert any(r["key_id"] is None and r["reason"] == "no key" for r in failed)
    assert all(r["client"] == "127.0.0.1" for r in failed)
    assert WRONG not in (Path(keyed.cfg.security.audit_dir or "") / "gateway.jsonl").read_text()


def test_the_key_decides_the_tenant_everywhere(keyed: Cluster) -> None:
    alice = _client(keyed, ALICE)
    assert [m.id for m in alice.models.list().data] == ["tiny"]
    raw = alice.completions.with_raw_response.create(model="tiny", prompt=SHORT, max_tokens=3, temperature=0)
    assert raw.parse().model_extra["crossfill"]["tenant_id"] == "alice"
    # Naming its own tenant is fine; naming another is refused, not silently rewritten.
    same = alice.completions.create(model="tiny", prompt=SHORT, max_tokens=2, extra_body={"tenant_id": "alice"})
    assert same.model_extra["crossfill"]["tenant_id"] == "alice"
    with pytest.raises(openai.PermissionDeniedError) as exc:
        alice.chat.completions.create(model="tiny", messages=[{"role": "user", "content": SHORT}], max_tokens=2,
                                      extra_body={"tenant_id": "bob"})
    assert exc.value.status_code == 403 and exc.value.body["code"] == "tenant_mismatch"
    # Azure-style header, streamed: the final chunk's route report carries the key's tenant.
    r = httpx.post(keyed.url + "/v1/generate", headers={"api-key": BOB}, timeout=60,
                   json={"prompt": SHORT, "max_tokens": 2, "stream": True})
    final = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]
    assert r.status_code == 200 and final["crossfill"]["tenant_id"] == "bob"
    denied = [r for r in _audit(keyed, "gateway") if r["event"] == "permission_denied"]
    assert any(r["tenant"] == "alice" and r["reason"] == "tenant_mismatch" for r in denied)


def test_admin_endpoints_need_an_admin_key_and_changes_are_audited(keyed: Cluster) -> None:
    url = _scheduler(keyed) + "/v1/admin/cluster"
    assert httpx.get(url, timeout=30, **keyed.tls).status_code == 401
    r = httpx.get(url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=30, **keyed.tls)
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30, **keyed.tls)
    assert r.status_code == 200 and "far-prefill-0" in r.json()["instances"]
    links = _scheduler(keyed) + "/v1/admin/links/far"
    assert httpx.post(links, json={"bandwidth_gbps": None}, timeout=30, **keyed.tls).status_code == 401
    r = httpx.post(links, json={"bandwidth_gbps": None}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30,
                   **keyed.tls)
    assert r.status_code == 200, r.text
    actions = [r for r in _audit(keyed, "scheduler") if r["event"] == "admin_action"]
    assert any(a["path"] == "/v1/admin/links/far" and a["method"] == "POST" and a["tenant"] == "ops"
               and a["outcome"] == 200 for a in actions)
    assert not any(a["method"] == "GET" for a in actions)  # reads are not changes
    denied = [r for r in _audit(keyed, "scheduler") if r["event"] in ("permission_denied", "auth_failed")]
    assert {r["event"] for r in denied} == {"permission_denied", "auth_failed"}


def _cli_verify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "crossfill.cli", "audit", "verify", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_audit_logs_verify_and_any_tampering_is_found(keyed: Cluster, tmp_path: Path) -> None:
    audit_dir = Path(keyed.cfg.security.audit_dir or "")
    for service in ("gateway", "scheduler"):
        out = _cli_verify(audit_dir / f"{service}.jsonl")
        assert out.returncode == 0 and out.stdout.startswith("ok:"), out.stderr
    lines = (audit_dir / "gateway.jsonl").read_text().splitlines()
    assert len(lines) >= 3
    edited = json.loads(lines[1])
    edited["client"] = "10.0.0.1"  # someone covering their tracks
    tampered = {
        "edited": [lines[0], json.dumps(edited, sort_keys=True, separators=(",", ":")), *lines[2:]],
        "removed": [lines[0], *lines[2:]],
        "reordered": [lines[1], lines[0], *lines[2:]],
    }
    for name, content in tampered.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(line + "\n" for line in content))
        out = _cli_verify(path)
        assert out.returncode == 1 and "TAMPERED" in out.stderr, (name, out.stdout, out.stderr)


@contextmanager
def _raw(c: Cluster, head: str, body: bytes = b"") -> Iterator[socket.socket]:
    gw = c.cfg.topology.gateway
    with socket.create_connection((gw.host, gw.port), timeout=120) as s:
        s.sendall(head.encode() + body)
        yield s


def _read_answer(s: socket.socket) -> tuple[int, dict, dict]:
    """Read until the server closes: (status, headers, JSON body)."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_concurrent_stream_limit_is_a_429_with_retry_after(keyed: Cluster) -> None:
    control = keyed.emulator_control("here-decode-0", "kv")
    far = keyed.worker_url("far-prefill-0") + "/v1/admin/stats"
    arm(control, stall_ms=FOREVER_MS)  # hold the streamer's one request in its KV transfer
    try:
        body = json.dumps({"prompt": LONG, "max_tokens": 4, "stream": True, "prefill_policy": "remote_required"})
        head = (f"POST /v1/generate HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {STREAMER}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        with _raw(keyed, head, body.encode()):
            wait_until("the streamer's request is in prefill and transfer",
                       lambda: httpx.get(far, timeout=5, **keyed.tls).json()["queue_depth"] >= 1
                       and keyed.kv("here-decode-0")["active_requests"] >= 1)
            with pytest.raises(openai.RateLimitError) as exc:
                _client(keyed, STREAMER).completions.create(model="tiny", prompt=SHORT, max_tokens=2)
            assert exc.value.body["code"] == "too_many_streams"
            assert int(exc.value.response.headers["retry-after"]) >= 1
            # Another tenant is not affected by the streamer's limit.
            assert _client(keyed, ALICE).completions.create(model="tiny", prompt=SHORT, max_tokens=2).choices
    finally:
        heal(keyed.emulator_control("here-decode-0", "kv"))
    wait_idle(keyed, WORKERS)
    # The client left: its slot is free again once the gateway noticed (the wait is only a safety net).
    streamer = _client(keyed, STREAMER)

    def admitted() -> bool:
        try:
            return bool(streamer.completions.create(model="tiny", prompt=SHORT, max_tokens=1).choices)
        except openai.RateLimitError:
            return False

    wait_until("the streamer's slot is released", admitted)
    limited = [r for r in _audit(keyed, "gateway") if r["event"] == "limit_exceeded"]
    assert any(r["tenant"] == "streamer" and r["code"] == "too_many_streams" for r in limited)


def test_a_body_over_max_body_bytes_is_a_413(keyed: Cluster) -> None:
    auth = {"Authorization": f"Bearer {ALICE}"}
    big = json.dumps({"prompt": "x" * (MAX_BODY + 1), "max_tokens": 1}).encode()
    r = httpx.post(keyed.url + "/v1/completions", content=big, headers={**auth, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    r = httpx.post(keyed.url + "/v1/completions", content=chunks(), headers={**auth, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_client_that_stalls_mid_body_gets_a_408(keyed: Cluster) -> None:
    body = json.dumps({"prompt": SHORT, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {ALICE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    t0 = time.monotonic()
    with _raw(keyed, head, body[: len(body) // 2]) as s:  # half the body, then silence
        status, headers, answer = _read_answer(s)  # the server answers, then closes
    assert status == 408 and answer["error"]["code"] == "request_timeout", answer
    assert headers.get("connection") == "close"
    print(f"408 after {time.monotonic() - t0:.1f}s (client_body_timeout_s {BODY_TIMEOUT_S})")
