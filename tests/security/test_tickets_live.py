"""Transfer tickets on a real cluster (processes started as `crossfill up` starts them; tickets on).

- A remote request is served under the ticket the scheduler signs with its route.
- A PrefillJob posted straight to a prefill instance without a ticket, under an altered, an
  expired or a replayed one, is refused with 403 before anything is computed or sent.
- KV pushed to decode's KV port for a real, expected cache id under a ticket that does not bind it
  (held by a "prefill" that decode itself asked, so it knows the cache id) is refused.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kv.helpers import Collector, hybrid_specs, make_kv
from serving.serving_cluster import Cluster, launch_cluster
from serving.serving_helpers import transfer_ticket, unique_long

from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Expectation
from crossfill.kv.errors import TransferError
from crossfill.kv.transports import make_receiver, make_sender
from crossfill.kv.wire import Manifest
from crossfill.security.paths import ticket_keys_path
from crossfill.security.tickets import TicketKeys, TicketVerifier

pytestmark = pytest.mark.timeout(600)
PREFILL, DECODE = "far-prefill-0", "here-decode-0"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("tickets")) as c:
        yield c


def _metrics(c: Cluster, name: str) -> str:
    return httpx.get(c.worker_url(name) + "/metrics", timeout=10, **c.tls).text


def refusals(c: Cluster, name: str) -> dict[str, float]:
    """crossfill_ticket_refusals_total of instance `name`, by reason."""
    found = re.findall(r'^crossfill_ticket_refusals_total\{reason="(\w+)"\} (\S+)$', _metrics(c, name), re.MULTILINE)
    return {reason: float(v) for reason, v in found}


def prefills_computed(c: Cluster) -> float:
    m = re.search(r"^crossfill_prefill_seconds_count (\S+)$", _metrics(c, PREFILL), re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def decode_transfers(c: Cluster) -> dict[str, int]:
    return httpx.get(c.worker_url(DECODE) + "/v1/admin/stats", timeout=10, **c.tls).json()["transfers"]


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(80)]


def _forge(token: str, **changes: object) -> str:
    """`token` with its payload edited and its signature kept."""
    body, mac = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload.update(changes)
    new = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).rstrip(b"=").decode()
    return f"{new}.{mac}"


def test_a_remote_request_is_served_under_the_scheduler_signed_ticket(cluster: Cluster) -> None:
    c = cluster
    r = httpx.post(c.cfg.scheduler_url() + "/v1/route", json={"request_id": "t-route", "prompt_tokens": 500,
                                                               "prefill_policy": "remote_required"},
                   timeout=30, **c.tls)
    assert r.status_code == 200, r.text
    route = r.json()
    verifier = TicketVerifier(TicketKeys(ticket_keys_path(c.cfg)), c.cfg.inference_service.kv_cache.max_retry)
    t = verifier.verify(route["ticket"], tenant="", decode=route["decode"], prefill=route["prefill"],
                        cache_id="t-route.x")
    assert t.prefills == (route["prefill"], *route["fallbacks"])
    body = {"prompt": unique_long(), "max_tokens": 6, "temperature": 0, "prefill_policy": "remote_required"}
    r = httpx.post(c.url + "/v1/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    info = r.json()["crossfill"]
    assert info["route"] == "remote" and info["prefill_instance"] == PREFILL and info["retries"] == 0, info
    assert not refusals(c, PREFILL) and not refusals(c, DECODE)


async def test_prefill_refuses_jobs_without_a_valid_ticket_before_computing(cluster: Cluster) -> None:
    c = cluster
    # KV of the one job that is let through goes to a receiver of the test's own, which expects it.
    rx = make_receiver("tcp", timeout_ms=60_000)
    async with rx, httpx.AsyncClient(timeout=120, **c.tls) as http:
        host, port = rx.address.rsplit(":", 1)

        def job(cache_id: str, ticket: str | None, tenant: str | None = None, seed: int = 0) -> dict[str, Any]:
            return {"request_id": cache_id.split(".")[0], "cache_id": cache_id, "prompt_token_ids": _prompt(seed),
                    "sampling": {"temperature": 0, "max_tokens": 2}, "kv_host": host, "kv_port": int(port),
                    "decode_instance": DECODE, "tenant_id": tenant, "ticket": ticket}

        async def post(j: dict[str, Any]) -> httpx.Response:
            async with http.stream("POST", c.worker_url(PREFILL) + "/v1/prefill", json=j) as r:
                await r.aread()  # to the stream's end: `done` or `error` (or the refusal)
                return r

        computed, seen = prefills_computed(c), refusals(c, PREFILL)
        acme = transfer_ticket(c.cfg, "t-alter", tenant="acme")
        cases = {
            "missing": job("t-none.1", None),
            "bad_signature": job("t-alter.1", _forge(acme, ten="mallory"), tenant="mallory"),
            "expired": job("t-old.1", transfer_ticket(c.cfg, "t-old", ttl_s=-1)),
            "wrong_prefill": job("t-other.1", transfer_ticket(c.cfg, "t-other", prefills=("here-prefill-0",))),
            "wrong_cache_id": job("t-mine.1", transfer_ticket(c.cfg, "t-yours")),
        }
        for reason, j in cases.items():
            r = await post(j)
            err = r.json()["error"]
            assert r.status_code == 403 and err["code"] == "invalid_transfer_ticket" and err["param"] == "ticket"
            assert reason in err["message"], err
        after = refusals(c, PREFILL)
        assert {k: after.get(k, 0) - seen.get(k, 0) for k in cases} == dict.fromkeys(cases, 1)
        assert prefills_computed(c) == computed and rx.counters().get("refused_unknown_cache_id", 0) == 0

        # A ticket captured from a real route: its first use computes and sends, a replay does not.
        route = (await http.post(c.cfg.scheduler_url() + "/v1/route", json={
            "request_id": "t-replay", "prompt_tokens": 80, "prefill_policy": "remote_required"})).json()
        assert route["prefill"] == PREFILL and route["decode"] == DECODE
        first = job("t-replay.1", route["ticket"], seed=1)
        sink = Collector()
        rx.expect(Expectation("t-replay.1", sink, timeout_s=60))
        r = await post(first)
        assert r.status_code == 200 and b'"event":"done"' in r.content, r.content[-300:]
        await rx.wait("t-replay.1")
        assert sink.calls > 0 and prefills_computed(c) == computed + 1
        r = await post(first)
        assert r.status_code == 403 and "replayed" in r.json()["error"]["message"]
        assert refusals(c, PREFILL).get("replayed", 0) == seen.get("replayed", 0) + 1
        assert prefills_computed(c) == computed + 1 and rx.counters()["transfers_expected"] == 1


async def test_decode_refuses_kv_under_a_ticket_that_does_not_bind_its_cache_id(cluster: Cluster) -> None:
    """A rogue "prefill" that decode itself asked knows a live cache id and holds a valid ticket for
    another request: every KV manifest it sends for that cache id under another ticket is refused."""
    c = cluster
    kv_port = c.cfg.instance(DECODE).kv_port
    outcomes: dict[str, str] = {}
    jobs: list[dict[str, Any]] = []

    async def push(cache_id: str, ticket: str | None) -> str:
        specs = hybrid_specs(n=2)
        m = Manifest.build(cache_id=cache_id, request_id=cache_id.split(".")[0], tenant="", fingerprint="0" * 64,
                           token_ids=_prompt(2), layer_specs=specs, frame_tokens=16, ticket=ticket)
        tx = make_sender("tcp", endpoint=("127.0.0.1", kv_port), connections=1, timeout_ms=30_000, max_retry=0)
        try:
            async with tx.open(m) as out:
                for layer, (k, v) in make_kv(specs, len(_prompt(2))).items():
                    await out.send(LayerKVChunk(layer, 0, k, v))
                await out.commit()
        except TransferError as exc:
            return f"{exc.reason.label}: {exc.message}"
        finally:
            await tx.close()
        return "accepted"

    async def rogue_prefill(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        job = json.loads(await reader.readexactly(length))
        jobs.append(job)
        if len(jobs) > 1:  # decode trying again: a refusal it will not retry
            body = json.dumps({"error": {"message": "no", "type": "invalid_request_error", "code": "x"}}).encode()
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\nconnection: close\r\n\r\n"
                         b'{"event":"accepted","instance":"rogue-prefill-0"}\n')
            await writer.drain()
            cid, ticket = job["cache_id"], job["ticket"]
            outcomes["wrong_cache_id"] = await push(cid, transfer_ticket(c.cfg, "other-request",
                                                                         prefills=("rogue-prefill-0",)))
            outcomes["wrong_decode"] = await push(cid, transfer_ticket(c.cfg, "forge-1", decode="here-decode-1",
                                                                       prefills=("rogue-prefill-0",)))
            outcomes["missing"] = await push(cid, None)
            outcomes["bad_signature"] = await push(cid, _forge(ticket, ten="mallory"))
            # The ticket decode gave it passes; the (fake) KV then fails the next check: the harness
            # reaches the real expectation, so what refused the others was the ticket.
            outcomes["control"] = await push(cid, ticket)
            writer.write(b'{"event":"error","status":400,"code":"x","message":"rogue prefill done"}\n')
        try:
            await writer.drain()
        except ConnectionError:
            pass  # decode already gave up on this attempt (its transfer failed) and hung up
        writer.close()

    server = await asyncio.start_server(rogue_prefill, "127.0.0.1", 0)
    rogue_port = server.sockets[0].getsockname()[1]
    seen, before = refusals(c, DECODE), decode_transfers(c)
    decode_job = {"request_id": "forge-1", "prompt_token_ids": _prompt(2),
                  "sampling": {"temperature": 0, "max_tokens": 2},
                  "route": {"kind": "remote", "prefill": "rogue-prefill-0", "decode": DECODE},
                  "endpoints": {"rogue-prefill-0": {"role": "prefill", "datacenter": "here", "host": "127.0.0.1",
                                                    "port": rogue_port}}}
    async with server, httpx.AsyncClient(timeout=300, **c.tls) as http:
        url = c.worker_url(DECODE) + "/v1/decode"
        r = await http.post(url, json=decode_job)  # no ticket: decode does not even start
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_transfer_ticket", r.text
        assert not jobs
        decode_job["ticket"] = transfer_ticket(c.cfg, "forge-1", prefills=("rogue-prefill-0",))
        r = await http.post(url, json=decode_job)
    assert r.status_code == 502, r.text  # every attempt failed: no KV was accepted
    assert jobs and jobs[0]["ticket"] == decode_job["ticket"]  # decode passed the route's ticket on
    for reason in ("wrong_cache_id", "wrong_decode", "missing", "bad_signature"):
        assert outcomes[reason].startswith("ticket: ") and reason in outcomes[reason], outcomes
    assert outcomes["control"].startswith("fingerprint_mismatch"), outcomes
    after = refusals(c, DECODE)
    assert {k: after.get(k, 0) - seen.get(k, 0) for k in ("wrong_cache_id", "wrong_decode", "bad_signature")} \
        == dict.fromkeys(("wrong_cache_id", "wrong_decode", "bad_signature"), 1)
    assert after["missing"] - seen.get("missing", 0) == 2  # the job without a ticket, then the manifest
    transfers = decode_transfers(c)
    assert transfers.get("refused_ticket", 0) - before.get("refused_ticket", 0) == 4
    assert transfers.get("transfers_completed", 0) == before.get("transfers_completed", 0)
