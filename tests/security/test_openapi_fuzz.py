"""The gateway's OpenAPI document is complete, and a fuzzer driven by it finds no 5xx and no answer off it.

A real tiny-model cluster (same processes as `crossfill up`) runs twice: with client auth off (as the
other serving tests run it) and with an API key required (`security.auth`, a dev key). Schemathesis
reads the live /openapi.json and, per operation, sends requests that follow the schema (positive)
and requests that break it (negative); every answer must be no server error, a documented status,
the documented content type and headers, a body (or, streamed, every event) that matches its
schema, and a schema-breaking request must be refused with a 4xx. Generation is bounded (a fixed
number of examples per operation, derandomized, max_tokens capped by the test, not by the
document), so the run takes about a minute per cluster even on a busy two-core machine.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving.serving_cluster import Cluster, launch_cluster
from serving.serving_helpers import FOREVER_MS, arm, heal, wait_until

FUZZ_KEY = "fuzz-key-0123456789abcdef"  # a dev key (security.auth.dev_keys), 16+ characters
MAX_TOKENS = 2  # what a generated request may generate: bounds the run, not the document
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}  # per operation
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


def _with_key(doc: dict) -> None:
    doc["security"]["auth"].update(enabled=True, dev_keys=[{"key": FUZZ_KEY, "tenant": "fuzz", "admin": False}])


@pytest.fixture(scope="module", params=["open", "keyed"])
def gateway(request: pytest.FixtureRequest, tiny_llama_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    """A cluster and the headers a client sends to it (pytest runs one parametrization after the other)."""
    keyed = request.param == "keyed"
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp(f"openapi-{request.param}"),
                        edit=_with_key if keyed else None) as c:
        yield c, {"Authorization": f"Bearer {FUZZ_KEY}"} if keyed else {}


def _document(c: Cluster, headers: dict[str, str]) -> dict[str, Any]:
    r = httpx.get(c.url + "/openapi.json", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# --------------------------------------------------------------------------- the document


def test_every_operation_declares_its_body_and_answers(gateway: tuple[Cluster, dict[str, str]]) -> None:
    c, headers = gateway
    doc = _document(c, headers)
    schemas = doc["components"]["schemas"]
    scheme = doc["components"]["securitySchemes"]["ApiKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")  # a fuzzer (or /docs) sends the key
    posts = [p for p, item in doc["paths"].items() if "post" in item]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/generate"} <= set(posts)
    for path in posts:
        body = doc["paths"][path]["post"].get("requestBody")
        assert body and body["required"] is True, f"POST {path} declares no required body"
        ref = body["content"]["application/json"]["schema"]["$ref"]
        declared = schemas[ref.rsplit("/", 1)[1]]
        assert declared["properties"] and declared.get("required"), f"POST {path}: empty body schema {declared}"
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"], path
    for path, item in doc["paths"].items():
        for method, op in item.items():
            ok = op["responses"].get("200")
            assert ok, f"{method.upper()} {path} declares no 200"
            for media, content in ok["content"].items():
                assert content.get("schema"), f"{method.upper()} {path}: no schema for {media}"
            if path.startswith("/v1/"):
                assert {"ApiKey": []} in op["security"], f"{method.upper()} {path} does not ask for the key"
                assert "401" in op["responses"], f"{method.upper()} {path} does not document 401"
    # The real constraints, so that generated requests are meaningful: the one served model, the ranges.
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == [c.cfg.model.api_name]
    assert chat["messages"]["minItems"] == 1
    assert chat["n"]["minimum"] == chat["n"]["maximum"] == 1
    assert set(chat["prefill_policy"]["enum"]) == {"auto", "local_only", "remote_preferred", "remote_required"}
    # Every $ref resolves.
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            refs.extend([node["$ref"]] if isinstance(node.get("$ref"), str) else [])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    missing = {r for r in refs if r.rsplit("/", 1)[1] not in schemas}
    assert not missing, missing


def test_the_keyed_cluster_really_asks_for_the_key(gateway: tuple[Cluster, dict[str, str]]) -> None:
    """Else the keyed fuzz run would prove nothing about the key the document declares."""
    c, headers = gateway
    r = httpx.get(c.url + "/v1/models", timeout=30)
    assert r.status_code == (401 if headers else 200), r.text
    assert httpx.get(c.url + "/v1/models", headers=headers, timeout=30).status_code == 200


def test_docs_page_renders(gateway: tuple[Cluster, dict[str, str]]) -> None:
    c, _ = gateway
    r = httpx.get(c.url + "/docs", timeout=30)
    assert r.status_code == 200 and "swagger-ui" in r.text and "/openapi.json" in r.text


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "2"}),
    ("/v1/generate", {"prompt": 7}),
    ("/v1/generate", [1, 2]),
])
def test_a_body_of_the_wrong_type_is_a_4xx_error_body(gateway: tuple[Cluster, dict[str, str]], path: str,
                                                      body: Any) -> None:
    c, headers = gateway
    r = httpx.post(c.url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["code"] in {"invalid_value", "invalid_json"}


# --------------------------------------------------------------------------- the fuzzer


def _cap_generation(case: schemathesis.Case) -> None:
    """Bound what a generated request generates; values the schema refuses stay as generated."""
    body = case.body
    if not isinstance(body, dict) or case.method != "POST":
        return
    keys = ("max_tokens", "max_completion_tokens") if case.path == "/v1/chat/completions" else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            body[key] = MAX_TOKENS if value is None else min(value, MAX_TOKENS)


def _fuzz(schema: schemathesis.BaseSchema, base_url: str, headers: dict[str, str], mode: GenerationMode,
          statuses: Counter[tuple[str, int]]) -> list[str]:
    """Run every operation's examples in `mode`; the failures, one line each (the first per operation)."""
    failures: list[str] = []
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == GenerationMode.NEGATIVE and not operation.body:
            continue  # nothing to break: GET operations without parameters

        @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:
            _cap_generation(case)
            response = case.call(base_url=base_url, headers=headers, timeout=120)
            statuses[(case.operation.label, response.status_code)] += 1
            case.validate_response(response, checks=checks, headers=headers)

        try:
            run()
        except (Exception, FailureGroup) as exc:  # noqa: BLE001 - collect every operation's failures, report all
            failures.append(f"{mode.value} {operation.label}: {exc}")
    return failures


def _examples(schema: schemathesis.BaseSchema, base_url: str, headers: dict[str, str]) -> list[str]:
    """Send the document's own request examples (streamed and not): each must work and match the document."""
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        content = (operation.definition.raw.get("requestBody") or {}).get("content", {}).get("application/json", {})
        for name, example in content.get("examples", {}).items():
            case = operation.Case(body=copy.deepcopy(example["value"]), media_type="application/json")
            _cap_generation(case)
            response = case.call(base_url=base_url, headers=headers, timeout=120)
            try:
                assert response.status_code == 200, f"answered {response.status_code}: {response.text[:500]}"
                case.validate_response(response, checks=CHECKS, headers=headers)
            except (Exception, FailureGroup) as exc:  # noqa: BLE001 - report every example's failure
                failures.append(f"example {name!r} of {operation.label}: {exc}")
    return failures


def test_fuzzing_the_live_document_finds_no_5xx_and_no_schema_violation(
        gateway: tuple[Cluster, dict[str, str]]) -> None:
    c, headers = gateway
    schema = schemathesis.openapi.from_dict(_document(c, headers))
    statuses: Counter[tuple[str, int]] = Counter()
    failures = _examples(schema, c.url, headers)
    failures += _fuzz(schema, c.url, headers, GenerationMode.POSITIVE, statuses)
    failures += _fuzz(schema, c.url, headers, GenerationMode.NEGATIVE, statuses)
    assert not failures, "\n\n".join(failures)
    # The documented constraints make generated requests meaningful: each endpoint really generated.
    for label in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/generate", "GET /v1/models"):
        assert statuses[(label, 200)] > 0, f"{label} never answered 200: {sorted(statuses.items())}"


# --------------------------------------------------------------------------- what the fuzzer found


@pytest.mark.parametrize("body, status, param", [
    # A request id with a line break broke the x-request-id response header (the connection dropped
    # without an answer); one outside Latin-1 made a 502 "decode stream broke: UnicodeEncodeError".
    ({"request_id": "a\nb"}, 400, "request_id"),
    ({"request_id": "\u00e9\u2603"}, 400, "request_id"),
    # A trace id is logged by every service: a line break forged log lines.
    ({"trace_id": "x\nrequest forged"}, 400, "trace_id"),
    # A tenant longer than a KV manifest field made every KV transfer fail (502).
    ({"tenant_id": "\u00e9" * 300}, 400, "tenant_id"),
    # Numbers are strict, as the document says ("number", not a string).
    ({"temperature": "0.5"}, 400, "temperature"),
    # A temperature so small that float32 logits overflowed: NaN probabilities, a 502 from prefill.
    ({"temperature": 1e-300}, 200, None),
])
def test_inputs_the_fuzzer_found_are_answered_without_5xx(gateway: tuple[Cluster, dict[str, str]], body: dict,
                                                          status: int, param: str | None) -> None:
    c, headers = gateway
    r = httpx.post(c.url + "/v1/generate", json={"prompt": "hello", "max_tokens": MAX_TOKENS, **body},
                   headers=headers, timeout=120)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


def test_a_request_id_in_flight_is_refused_not_shared(gateway: tuple[Cluster, dict[str, str]]) -> None:
    """Workers key aborts and KV by request id: a second request with the id of one in flight aborted
    the first (both ended 503). Now the second gets a 409 and the first finishes untouched."""
    c, headers = gateway
    kv_link = c.emulator_control("here-decode-0", "kv")
    first = {"prompt": "held in flight", "max_tokens": MAX_TOKENS, "prefill_policy": "remote_required",
             "request_id": "dup-1"}
    arm(kv_link, stall_ms=FOREVER_MS)  # the first request's KV waits on the link until the test heals it
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, c.url + "/v1/generate", json=first, headers=headers, timeout=120)
            wait_until("the first request is in flight at decode",
                       lambda: c.kv("here-decode-0")["active_requests"] > 0)
            second = httpx.post(c.url + "/v1/generate", json={"prompt": "x", "max_tokens": 1, "request_id": "dup-1"},
                                headers=headers, timeout=120)
            heal(kv_link)
            r = held.result()
    finally:
        heal(kv_link)
    assert second.status_code == 409 and second.json()["error"]["code"] == "duplicate_request_id", second.text
    assert r.status_code == 200 and r.json()["request_id"] == "dup-1", r.text
