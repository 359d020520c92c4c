"""Prompts and outputs never reach a log: every log and audit file of a real run is searched for them.

The cluster runs as a deployment would: `crossfill up` in its own process, every service logging at
debug level into files (up's stderr and stdout, which its children inherit), the audit log on, API
keys on. Traffic of every kind carries a distinctive prompt: chat and completions, streamed and
not, local and remote prefill, refusals (wrong tenant, over the stream limit, a bad field). Then
every file the run wrote is searched for the prompt and for every completion text.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from serving.serving_cluster import Cluster, cluster_config, free_port_block, quiet_timeouts
from serving.serving_helpers import LONG

from crossfill.config import load_config
from crossfill.reliability.procs import UpProcess

pytestmark = pytest.mark.timeout(600)

KEY = "redaction-key-0123456789abcdef"
ADMIN = "redaction-admin-0123456789abcdef"
SECRET = f"Quokka-{uuid.uuid4().hex[:12]}-ledger"  # appears nowhere unless something logs a prompt


@pytest.fixture(scope="module")
def run_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    run = tmp_path_factory.mktemp("redaction")
    doc = quiet_timeouts(cluster_config(tiny_llama_dir, free_port_block(120)))
    doc["model"]["served_name"] = "tiny"
    doc["inference_service"]["observability"]["log_level"] = "debug"  # the chattiest setting
    doc["security"].update(dir=str(run / "security"), audit_dir=str(run / "audit"))
    doc["security"]["auth"].update(enabled=True, dev_keys=[{"key": KEY, "tenant": "t"},
                                                           {"key": ADMIN, "tenant": "ops", "admin": True}])
    doc["security"]["limits"] = {"tenants": {"t": {"max_concurrent_streams": 64}}}
    path = run / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    up = UpProcess(path, run / "logs" / "up.log")
    try:
        asyncio.run(up.start(300))
        c = Cluster(load_config(path), path, [])
        c.wait_scheduler(lambda v: all(i["healthy"] and i["ready"] for i in v["instances"].values()))
        yield c, run
    finally:
        up.stop(60)


def _traffic(c: Cluster) -> list[str]:
    """Requests of every kind carrying SECRET; returns every completion text the cluster produced."""
    client = openai.OpenAI(base_url=c.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    texts = []
    # Sampled (seeded), not greedy: a random tiny model's greedy output is often one token repeated.
    sample = {"max_tokens": 24, "temperature": 1.0}
    for prompt, policy in ((f"{SECRET} short", "local_only"), (f"{SECRET} {LONG}", "remote_required")):
        extra = {"prefill_policy": policy, "ignore_eos": True}
        msgs = [{"role": "user", "content": prompt}]
        texts.append(client.completions.create(model="tiny", prompt=prompt, seed=1, extra_body=extra,
                                               **sample).choices[0].text)
        texts.append(client.chat.completions.create(model="tiny", messages=msgs, seed=2, extra_body=extra,
                                                    **sample).choices[0].message.content or "")
        stream = client.chat.completions.create(model="tiny", messages=msgs, seed=3, stream=True, extra_body=extra,
                                                **sample)
        texts.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
        r = httpx.post(c.url + "/v1/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"prompt": prompt, "seed": 4, "ignore_eos": True, "prefill_policy": policy, **sample})
        assert r.status_code == 200, r.text
        texts.append(r.json()["text"])
    # Refusals that carry the prompt too.
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model="tiny", prompt=SECRET, max_tokens=2, extra_body={"tenant_id": "other"})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=SECRET, max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": SECRET}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=c.url + "/v1", api_key="cf-wrong-key-000000000000", max_retries=0).completions.create(
            model="tiny", prompt=SECRET, max_tokens=2)
    return texts


def test_no_prompt_and_no_output_in_any_log_or_audit_file(run_dir: tuple[Cluster, Path]) -> None:
    c, run = run_dir
    texts = _traffic(c)
    # Distinctive outputs only (no run of one character that a log could hold by chance).
    outputs = [t.strip() for t in texts if len(t.strip()) >= 12 and len(set(t.strip())) >= 6]
    assert len(outputs) >= 4, texts  # enough for the search to mean something
    files = [p for p in run.rglob("*") if p.is_file()]
    logs = [p for p in files if p.suffix in (".log", ".jsonl")]
    assert {p.name for p in logs} >= {"up.log", "up.stdout.log", "gateway.jsonl"}
    assert f"API key for tenant t: {KEY}" in (run / "logs" / "up.stdout.log").read_text()  # `up` tells the demo keys
    log_text = (run / "logs" / "up.log").read_text()
    # The services did log, at debug level, about these very requests (the search is not of empty files).
    assert '"tenant_id":"t"' in log_text  # the JSON request lines (crossfill.requests)
    assert " DEBUG " in log_text
    audit = [json.loads(line) for line in (run / "audit" / "gateway.jsonl").read_text().splitlines()]
    assert {"auth_failed", "permission_denied"} <= {r["event"] for r in audit}
    for p in files:
        data = p.read_bytes()
        assert SECRET.encode() not in data, f"the prompt is in {p}"
        for out in outputs:
            assert out.encode() not in data, f"a completion text ({out[:30]!r}...) is in {p}"
