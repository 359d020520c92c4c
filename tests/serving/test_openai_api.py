"""The gateway through the official `openai` client: chat and completions, streamed and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving_helpers import SHORT, unique_long

ALL_WORKERS = ["here-prefill-0", "here-decode-0", "far-prefill-0"]


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_streamed_equals_not_streamed_and_reports_route(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": SHORT}]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=msgs, max_tokens=10,
                                                           temperature=0)
    resp = raw.parse()
    text = resp.choices[0].message.content
    assert resp.usage.completion_tokens == 10 and resp.choices[0].finish_reason == "length"
    info = resp.model_extra["crossfill"]
    assert info["route"] == "local" and info["decode_instance"] == "here-decode-0"
    assert info["prefill_instance"] == "here-prefill-0" and info["cache_id"]
    assert info["kv_raw_bytes"] > 0 and info["kv_wire_bytes"] > 0
    assert {"queue", "prefill", "transfer", "first_token", "decode"} <= set(info["timings_ms"])
    header = json.loads(raw.headers["x-crossfill-route"])
    assert header["route"] == "local" and header["cache_id"] == info["cache_id"]

    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length"
    assert final.usage.completion_tokens == 10
    assert final.model_extra["crossfill"]["route"] == "local"


def test_long_prompt_goes_remote_with_kv_bytes_and_stage_timings(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny", prompt=unique_long(), max_tokens=8, temperature=0)
    info = resp.model_extra["crossfill"]
    assert info["route"] == "remote" and info["prefill_instance"] == "far-prefill-0"
    assert info["retries"] == 0 and info["degradation_reason"] is None
    assert info["kv_raw_bytes"] > 0 and info["kv_wire_bytes"] > 0
    t = info["timings_ms"]
    assert t["first_token"] >= t["prefill"] and t["transfer"] > 0


def test_prefill_policy_as_extra_field_and_streaming_completions(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="tiny", prompt=SHORT, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"prefill_policy": "remote_required", "tenant_id": "t1"})
    chunks = list(stream)
    info = chunks[-1].model_extra["crossfill"]
    assert info["route"] == "remote" and info["tenant_id"] == "t1"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequence_and_seeded_sampling(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt=SHORT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[3:6]
    assert stop
    stopped = client.completions.create(model="tiny", prompt=SHORT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    a = client.completions.create(model="tiny", prompt=SHORT, max_tokens=12, temperature=1.0, seed=7, top_p=0.9)
    b = client.completions.create(model="tiny", prompt=SHORT, max_tokens=12, temperature=1.0, seed=7, top_p=0.9)
    assert a.choices[0].text == b.choices[0].text


def test_native_generate(cluster) -> None:
    r = httpx.post(cluster.url + "/v1/generate", timeout=60, json={
        "request_id": "native-1", "prompt": unique_long(), "max_tokens": 5, "stream": False, "prefill_policy": "auto",
        "tenant_id": "acme", "trace_id": "trace-abc", "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == "native-1" and len(body["token_ids"]) == 5
    assert body["crossfill"]["route"] == "remote" and body["crossfill"]["trace_id"] == "trace-abc"
    assert json.loads(r.headers["x-crossfill-route"])["route"] == "remote"
    with httpx.stream("POST", cluster.url + "/v1/generate", timeout=60, json={
            "prompt": SHORT, "max_tokens": 5, "stream": True, "temperature": 0}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert sum(len(e.get("token_ids", [])) for e in events) == 5
    assert events[-1]["crossfill"]["route"] == "local" and events[-1]["usage"]["completion_tokens"] == 5


def test_bad_input_names_the_field(cluster, client: openai.OpenAI) -> None:
    url = cluster.url

    def post(path: str, body: object, raw: bool = False) -> httpx.Response:
        if raw:
            return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        return httpx.post(url + path, json=body, timeout=30)

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (post("/v1/chat/completions", b'{"model": "tiny", "messages": [', raw=True), 400, None, "invalid_json"),
        (post("/v1/chat/completions", {"model": "tiny"}), 400, "messages", "missing_field"),
        (post("/v1/chat/completions", {**chat, "max_tokens": "5"}), 400, "max_tokens", None),
        (post("/v1/chat/completions", {**chat, "max_tokens": 0}), 400, "max_tokens", None),
        (post("/v1/chat/completions", {**chat, "max_tokens": 100000}), 400, "max_tokens", "context_length_exceeded"),
        (post("/v1/chat/completions", {**chat, "temperature": -1}), 400, "temperature", None),
        (post("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}), 400,
         "messages.0.role", None),
        (post("/v1/chat/completions", {**chat, "model": "gpt-17"}), 404, "model", "model_not_found"),
        (post("/v1/chat/completions", {**chat, "prefill_policy": "sometimes"}), 400, "prefill_policy", None),
        (post("/v1/chat/completions", {**chat, "stream": True, "max_tokens": -3}), 400, "max_tokens", None),
        (post("/v1/completions", {"model": "tiny", "prompt": "x" * 30000}), 400, "prompt", "context_length_exceeded"),
        (post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**6]}), 400, "prompt", "invalid_token_id"),
        (post("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}), 400, "prompt", None),
        (post("/v1/generate", {"max_tokens": 3}), 400, "prompt", "missing_field"),
        (post("/v1/generate", {"prompt": "hi", "stream": "yes"}), 400, "stream", None),
        (httpx.get(url + "/v1/nothing-here"), 404, None, "not_found"),
    ]
    for resp, status, param, code in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, err
        if code is not None:
            assert err["code"] == code, err
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert "max_tokens" in str(e.value)
