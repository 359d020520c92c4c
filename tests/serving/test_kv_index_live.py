"""The KV index's wire: a real prefill worker's stats with kv_events, the bandwidth probe, and the
gateway's route query carrying the prompt's block hashes (never its tokens)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from serving_cluster import cluster_config, free_port_block

from crossfill.config import parse_config
from crossfill.engine.block_pool import DEFAULT_BLOCK_SIZE, prompt_block_hashes
from crossfill.engine.sampling import SamplingParams
from crossfill.policy.kv_index import KVIndex
from crossfill.serving.connector import import_namespace
from crossfill.serving.errors import APIError
from crossfill.serving.gateway import Backoff, Gateway, _Job
from crossfill.serving.openai_schema import SamplingFields
from crossfill.serving.prefill_worker import create_prefill_app
from crossfill.serving.protocol import RouteQuery
from crossfill.serving.worker_common import PROBE_MAX_BYTES


def test_worker_publishes_its_prefix_cache_and_serves_probe_bytes(tiny_llama_dir: Path) -> None:
    cfg = parse_config(cluster_config(tiny_llama_dir, free_port_block(120)))
    app = create_prefill_app(cfg, cfg.instance("here-prefill-0"))
    bs = DEFAULT_BLOCK_SIZE
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.01)
        plain = client.get("/v1/admin/stats").json()
        assert plain["block_size"] == bs and "kv_events" not in plain
        index = KVIndex()
        first = client.get("/v1/admin/stats", params=index.query_params("here-prefill-0")).json()
        assert first["block_size"] == bs and first["instance"] == "here-prefill-0"
        events = first["kv_events"]
        assert events["reset"] and events["evicted"] == [] and len(events["epoch"]) == 16
        index.update("here-prefill-0", events)

        rng = random.Random(0)
        prompt = [rng.randrange(3, 300) for _ in range(3 * bs + 5)]
        engine = app.state.worker.engine

        async def generate() -> None:
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            async for _ in engine.generate("kv-live", prompt, params, namespace="tenant-x"):
                pass

        client.portal.call(generate)
        delta = client.get("/v1/admin/stats", params=index.query_params("here-prefill-0")).json()["kv_events"]
        want = prompt_block_hashes(prompt, "tenant-x", bs)
        assert not delta["reset"] and set(delta["stored"]) == set(want) and delta["epoch"] == events["epoch"]
        index.update("here-prefill-0", delta)
        assert index.cached_prefix_tokens("here-prefill-0", want, bs) == 3 * bs
        assert index.cached_tokens(prompt_block_hashes(prompt, "", bs), bs) == {}

        # Asked with another epoch (the scheduler knew a previous life): the full set at once.
        stale = {"kv_events_since": delta["next"], "kv_epoch": "old"}
        again = client.get("/v1/admin/stats", params=stale).json()
        assert again["kv_events"]["reset"] and set(again["kv_events"]["stored"]) == set(want)
        bad = client.get("/v1/admin/stats", params={"kv_events_since": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_events_since"

        r = client.get("/v1/admin/probe", params={"bytes": 1000})
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        assert len(r.content) == 1000 and len(set(r.content)) > 200  # random bytes, not a constant
        biggest = client.get("/v1/admin/probe", params={"bytes": PROBE_MAX_BYTES})
        assert len(biggest.content) == PROBE_MAX_BYTES
        for n in (0, -1, PROBE_MAX_BYTES + 1, "many", None):
            r = client.get("/v1/admin/probe", params={} if n is None else {"bytes": n})
            assert r.status_code == 400 and r.json()["error"]["param"] == "bytes", n


@pytest.mark.parametrize("codec", ["fp8", "lz4"])
async def test_gateway_route_query_carries_block_hashes_only(tiny_llama_dir: Path, codec: str) -> None:
    raw = cluster_config(tiny_llama_dir, 30000, kv_cache={"codec": codec})
    cfg = parse_config(raw)
    sent: list[dict] = []

    def scheduler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "seen", "code": "test"}})

    gateway = Gateway(cfg)
    gateway.http = httpx.AsyncClient(transport=httpx.MockTransport(scheduler))
    tokens = list(range(3, 3 + 70 * DEFAULT_BLOCK_SIZE + 7))
    job = _Job("generate", "r1", "tiny", tokens, SamplingParams(), SamplingFields(tenant_id="acme"))
    with pytest.raises(APIError, match="seen"):
        await gateway.route(job, Backoff(0.0), [])
    await gateway.http.aclose()
    query = RouteQuery.model_validate(sent[0])  # what the scheduler parses
    assert query.prefix_hashes == prompt_block_hashes(tokens, "acme", DEFAULT_BLOCK_SIZE)
    assert len(query.prefix_hashes) == 70
    decode_ns = import_namespace(cfg, "acme")
    if decode_ns == "acme":
        assert query.decode_prefix_hashes is None and "decode_prefix_hashes" not in sent[0]
    else:
        assert query.decode_prefix_hashes == prompt_block_hashes(tokens, decode_ns, DEFAULT_BLOCK_SIZE)
    assert (codec == "fp8") == (decode_ns != "acme")  # KV through a lossy codec: a namespace of its own
    assert not any(isinstance(v, list) and v and isinstance(v[0], int) for v in sent[0].values())  # no tokens
