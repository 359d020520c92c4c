"""Decode's ticket check on every KV transport: real receivers and senders on local sockets.

The check sits in the one verifier every receiver uses (crossfill.kv.assembler), wired by the
decode worker's `TicketGate.manifest_check`; this proves each backend carries the manifest's ticket
to it and refuses KV whose ticket does not bind the cache id, the decode instance and the tenant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv.helpers import Collector, hybrid_specs, make_kv
from serving.serving_cluster import cluster_config

from crossfill.config import parse_config
from crossfill.engine.types import LayerKVChunk
from crossfill.kv.assembler import Expectation
from crossfill.kv.backend import ReceiveBackend, TransferBackend
from crossfill.kv.errors import Reason, TransferError
from crossfill.kv.sender import parse_endpoint
from crossfill.kv.store import EmbeddedStore
from crossfill.kv.transports import make_receiver, make_sender, make_te_engine
from crossfill.kv.wire import Manifest
from crossfill.serving.metrics import ServingMetrics
from crossfill.serving.transfer_tickets import TicketGate

pytestmark = pytest.mark.timeout(120)
TOKENS = 40
TENANT = "tenant-a"


@pytest.fixture(scope="module")
def te_engine():
    from crossfill.kv.mooncake_te import MooncakeTEError

    try:
        return make_te_engine()
    except MooncakeTEError as exc:
        pytest.skip(str(exc))


def _manifest(cache_id: str, ticket: str | None) -> Manifest:
    return Manifest.build(cache_id=cache_id, request_id=cache_id.split(".")[0], tenant=TENANT, fingerprint="f" * 64,
                          token_ids=list(range(TOKENS)), layer_specs=hybrid_specs(n=3), frame_tokens=16,
                          ticket=ticket)


async def _send(tx: TransferBackend, m: Manifest) -> None:
    kv = make_kv(hybrid_specs(n=3), TOKENS)
    async with tx.open(m) as out:
        for layer in sorted(kv):
            await out.send(LayerKVChunk(layer, 0, *kv[layer]))
        await out.commit()


def _metric(metrics: ServingMetrics, reason: str) -> float:
    return metrics.ticket_refusals.labels(reason)._value.get()


@pytest.mark.parametrize("transport", ["tcp", "store", pytest.param("mooncake_te", marks=pytest.mark.mooncake)])
async def test_every_transport_refuses_kv_whose_ticket_does_not_permit_it(request, transport: str) -> None:
    cfg = parse_config(cluster_config(Path("unused"), 20000))  # the config only: nothing is started
    metrics = ServingMetrics()
    gate = TicketGate(cfg, "here-decode-0", metrics)
    scheduler = TicketGate(cfg, "scheduler", ServingMetrics())
    assert gate.signer is not None and scheduler.signer is not None

    def ticket(request_id: str, decode: str = "here-decode-0", tenant: str = TENANT) -> str:
        return scheduler.signer.sign(request_id=request_id, tenant=tenant, decode=decode,  # type: ignore[union-attr]
                                     prefills=("far-prefill-0",))

    forged = {  # what a cluster member holding some other valid ticket could present
        "wrong_cache_id": ticket("req-other"),
        "wrong_decode": ticket("req-7", decode="here-decode-1"),
        "wrong_tenant": ticket("req-7", tenant="tenant-b"),
        "missing": None,
    }
    te = request.getfixturevalue("te_engine") if transport == "mooncake_te" else None
    store = EmbeddedStore(memory_capacity_bytes=64 << 20) if transport == "store" else None
    rx: ReceiveBackend = make_receiver(transport, timeout_ms=30_000, store=store, te=te)
    async with rx:
        tx = make_sender(transport, endpoint=parse_endpoint(rx.address), connections=1, timeout_ms=30_000,
                         max_retry=1, te=te)

        def expect(cache_id: str) -> Collector:
            sink = Collector()
            rx.expect(Expectation(cache_id, sink, tenant=TENANT, timeout_s=30, authorize=gate.manifest_check(
                cache_id=cache_id, tenant=TENANT, prefill="far-prefill-0")))
            return sink

        for i, (reason, bad) in enumerate(forged.items()):
            # The store path reads the manifest once and fails the transfer; the streaming paths
            # refuse the sender and keep waiting for a permitted one on the same cache id.
            cache_id = f"req-7.{i}" if transport == "store" else "req-7.a"
            if transport == "store" or i == 0:
                sink = expect(cache_id)
            if transport == "store":
                await _send(tx, _manifest(cache_id, bad))
                with pytest.raises(TransferError) as info:
                    await rx.wait(cache_id)
            else:
                with pytest.raises(TransferError) as info:
                    await _send(tx, _manifest(cache_id, bad))
            assert info.value.reason is Reason.TICKET and reason in str(info.value), info.value
            assert sink.calls == 0  # not a single frame reached the engine
            assert _metric(metrics, reason) == 1
        good = "req-7.b" if transport == "store" else "req-7.a"
        if transport == "store":
            sink = expect(good)
        await _send(tx, _manifest(good, ticket("req-7")))
        assert (await rx.wait(good)).cache_id == good and sink.calls > 0
        # (the store puller counts a manifest refusal twice, as it does for every reason)
        assert rx.counters()["refused_ticket"] == len(forged) * (2 if transport == "store" else 1)
        await tx.close()
    if store is not None:
        store.close()


# --------------------------------------------------------------------------- the gate's modes


def _config(security: dict) -> object:
    doc = cluster_config(Path("unused"), 20000)
    doc["security"].update(security)
    return parse_config(doc)


def test_tickets_off_sign_nothing_and_check_nothing_and_need_no_keys(tmp_path: Path) -> None:
    from crossfill.policy.routing import Route
    from crossfill.serving.protocol import PrefillJob

    cfg = _config({"dir": str(tmp_path), "tickets": {"enabled": False}})  # an empty folder: no tickets.json
    gate = TicketGate(cfg, "far-prefill-0", ServingMetrics())
    assert gate.sign("r", None, Route("remote", "far-prefill-0", "here-decode-0")) is None
    gate.check_prefill_job(PrefillJob(request_id="r", cache_id="r.1", prompt_token_ids=[1], sampling={},
                                      kv_host="h", kv_port=1, decode_instance="here-decode-0"))
    assert gate.manifest_check(cache_id="r.1", tenant="", prefill="far-prefill-0") is None


def test_tickets_on_without_keys_stop_the_service_at_start(tmp_path: Path) -> None:
    from crossfill.config import ConfigError

    with pytest.raises(ConfigError, match="security.dir: cannot read the ticket signing keys .*certs init"):
        TicketGate(_config({"dir": str(tmp_path)}), "scheduler", ServingMetrics())


def test_a_refusal_is_an_audit_record_without_prompt_content(tmp_path: Path) -> None:
    from crossfill.security.audit import AuditLog, verify
    from crossfill.serving.errors import APIError
    from crossfill.serving.protocol import PrefillJob

    cfg = _config({})
    audit = AuditLog(tmp_path / "far-prefill-0.jsonl", "far-prefill-0")
    metrics = ServingMetrics()
    gate = TicketGate(cfg, "far-prefill-0", metrics, audit)
    job = PrefillJob(request_id="r", cache_id="r.1", prompt_token_ids=[4242, 4243], sampling={}, kv_host="h",
                     kv_port=1, decode_instance="here-decode-0", tenant_id="acme", ticket="garbage")
    with pytest.raises(APIError) as e:
        gate.check_prefill_job(job)
    assert e.value.status == 403 and e.value.code == "invalid_transfer_ticket" and "malformed" in e.value.message
    assert _metric(metrics, "malformed") == 1
    assert verify(audit.path).ok
    rec = json.loads(audit.path.read_text())
    assert (rec["event"], rec["reason"], rec["where"], rec["cache_id"], rec["tenant"]) == (
        "ticket_refused", "malformed", "prefill_job", "r.1", "acme")
    assert "4242" not in audit.path.read_text()
