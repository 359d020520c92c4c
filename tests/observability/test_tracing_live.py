"""One trace per request across every process of a running cluster, including a retried KV transfer.

The cluster runs with `observability.trace_file` (a JSON-lines file per process) and
`observability.otlp_endpoint` pointed at a small OTLP/HTTP receiver in this test. Two remote
requests (`prefill_policy: remote_required`): one with a client trace id of 32 hex digits, and one
whose first KV transfer attempt is stalled on the emulated WAN until decode gives up on it (the test
heals the link once decode counted the retry). Stopping the cluster (SIGTERM, as `crossfill up`
does) writes out every span; the spans are then read back from every process's file and checked:
one trace per request, spans from gateway, scheduler, decode and prefill in the right tree (the
prefill's under decode's attempt, decode's import under the prefill's send, named by the manifest's
traceparent), two attempts for the retried request with the first an error, the same spans at the
collector, and no prompt or output text anywhere.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from serving.serving_cluster import launch_cluster
from serving.serving_helpers import FOREVER_MS, LONG, arm, counter, generate, heal, wait_until

pytestmark = pytest.mark.timeout(600)

MARK = f"Okapi-{uuid.uuid4().hex[:10]}"  # in every prompt; must appear in no span
PROMPT = f"{MARK} {LONG}"
DECODE, PREFILL = "here-decode-0", "far-prefill-0"
SERVICES = {"gateway", "scheduler", DECODE, PREFILL}


class _Collector(ThreadingHTTPServer):
    """An OTLP/HTTP receiver: keeps every export request's body."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.path == "/v1/traces":
                    collector.bodies.append(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        collector = self
        super().__init__(("127.0.0.1", 0), Handler)

    def spans(self) -> set[tuple[str, str, str, str]]:
        """(trace id, span id, name, instance) of everything exported."""
        out = set()
        for body in self.bodies:
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                inst = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.instance.id")
                for ss in rs.scope_spans:
                    out |= {(s.trace_id.hex(), s.span_id.hex(), s.name, inst) for s in ss.spans}
        return out


@pytest.fixture(scope="module")
def collector() -> Iterator[_Collector]:
    server = _Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, collector: _Collector) -> dict[str, Any]:
    """Run the two requests on a traced cluster, stop it, and return the answers and the span files."""
    tmp = tmp_path_factory.mktemp("traced")
    spans_dir = tmp / "spans"
    given = uuid.uuid4().hex
    with launch_cluster(str(tiny_llama_dir), tmp, observability={
            "trace_file": str(spans_dir / "spans.jsonl"),
            "otlp_endpoint": f"http://127.0.0.1:{collector.server_address[1]}"}) as c:
        plain = generate(c.url, PROMPT, "remote_required", max_tokens=8, tenant_id="trace-plain", trace_id=given)
        assert plain.status_code == 200, plain.text
        kv_link = c.emulator_control(DECODE, "kv")
        decode = c.worker_url(DECODE)
        retries = counter(decode, "crossfill_kv_retries")
        arm(kv_link, stall_ms=FOREVER_MS)  # the first attempt's KV never arrives: decode gives up on it
        try:
            with cf.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(generate, c.url, PROMPT, "remote_required", max_tokens=8, tenant_id="trace-retry")
                wait_until("decode gave up on the stalled attempt",
                           lambda: counter(decode, "crossfill_kv_retries") > retries)
                heal(kv_link)  # the retry gets its KV
                retried = fut.result()
        finally:
            heal(kv_link)
        assert retried.status_code == 200, retried.text
    # The cluster has stopped: every process wrote out its spans on the way down.
    files = sorted(spans_dir.glob("spans.*.jsonl"))
    return {"given": given, "plain": plain.json(), "retried": retried.json(), "files": files,
            "spans": [json.loads(line) for f in files for line in f.read_text().splitlines()]}


def _trace(spans: list[dict], trace_id: str) -> list[dict]:
    return [s for s in spans if s["context"]["trace_id"] == "0x" + trace_id]


def _inst(span: dict) -> str:
    return span["resource"]["attributes"]["service.instance.id"]


def _tree(trace: list[dict]) -> tuple[dict, dict[str, dict], dict[str, list[dict]]]:
    """(root, spans by id, children by parent id); asserts one root and no span without its parent."""
    by_id = {s["context"]["span_id"]: s for s in trace}
    roots = [s for s in trace if s["parent_id"] is None]
    assert [r["name"] for r in roots] == ["gateway.request"], roots
    children: dict[str, list[dict]] = defaultdict(list)
    for s in trace:
        if s["parent_id"] is not None:
            assert s["parent_id"] in by_id, f"{s['name']} on {_inst(s)} has a parent outside the trace"
            children[s["parent_id"]].append(s)
    return roots[0], by_id, children


def _one(spans: list[dict], name: str) -> dict:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, found)
    return found[0]


def _check_attempt(attempt: dict, children: dict[str, list[dict]], ok: bool) -> None:
    """A transfer attempt: the prefill's request under it, and, when it succeeded, the whole path."""
    kids = children[attempt["context"]["span_id"]]
    pre = _one([k for k in kids if k["name"] == "prefill.request"], "prefill.request")
    assert _inst(pre) == PREFILL and pre["kind"] == "SpanKind.SERVER"
    if not ok:
        return
    under = children[pre["context"]["span_id"]]
    assert {"prefill.queue", "prefill.compute", "kv.send"} <= {s["name"] for s in under}
    send = _one(under, "kv.send")
    assert send["attributes"]["crossfill.outcome"] == "ok" and send["attributes"]["crossfill.kv.wire_bytes"] > 0
    # decode's import, in the decode process, hangs under the prefill's send: the manifest carried it.
    imp = _one(children[send["context"]["span_id"]], "decode.kv_import")
    assert _inst(imp) == DECODE and imp["attributes"]["crossfill.outcome"] == "ok"
    assert imp["attributes"]["crossfill.kv.wire_bytes"] == send["attributes"]["crossfill.kv.wire_bytes"]


def test_a_remote_request_is_one_trace_across_every_process(traced: dict[str, Any]) -> None:
    info = traced["plain"]["crossfill"]
    assert info["trace_id"] == traced["given"] and info["route"] == "remote"  # the client's id is the trace id
    trace = _trace(traced["spans"], traced["given"])
    root, by_id, children = _tree(trace)
    assert {_inst(s) for s in trace} == SERVICES  # and nothing from the local prefill
    assert _inst(root) == "gateway" and root["attributes"]["crossfill.outcome"] == "ok"
    assert [e["name"] for e in root["events"]] == ["first_token"]
    top = {s["name"]: s for s in children[root["context"]["span_id"]]}
    assert {"scheduler.route", "decode.request"} <= set(top)
    assert _inst(top["scheduler.route"]) == "scheduler"
    assert top["scheduler.route"]["attributes"]["crossfill.route.kind"] == "remote"
    dec = top["decode.request"]
    assert _inst(dec) == DECODE
    steps = children[dec["context"]["span_id"]]
    assert {"decode.kv_attempt", "decode.first_token", "decode.generate"} <= {s["name"] for s in steps}
    attempt = _one(steps, "decode.kv_attempt")
    a = attempt["attributes"]
    assert (a["crossfill.attempt"], a["crossfill.outcome"], a["crossfill.kv.transport"]) == (1, "ok", "tcp")
    assert a["crossfill.kv.wire_bytes"] == info["kv_wire_bytes"] and a["crossfill.kv.raw_bytes"] == info["kv_raw_bytes"]
    _check_attempt(attempt, children, ok=True)
    gen = _one(steps, "decode.generate")
    assert gen["attributes"]["crossfill.completion_tokens"] == traced["plain"]["usage"]["completion_tokens"]
    assert by_id[dec["parent_id"]] is root


def test_a_retried_transfer_shows_both_attempts_the_first_failed(traced: dict[str, Any]) -> None:
    info = traced["retried"]["crossfill"]
    assert info["retries"] == 1 and len(info["trace_id"]) == 32  # no client id: the report gives the trace id
    trace = _trace(traced["spans"], info["trace_id"])
    root, _, children = _tree(trace)
    assert {_inst(s) for s in trace} == SERVICES
    dec = _one(children[root["context"]["span_id"]], "decode.request")
    attempts = sorted((s for s in children[dec["context"]["span_id"]] if s["name"] == "decode.kv_attempt"),
                      key=lambda s: s["attributes"]["crossfill.attempt"])
    assert [s["attributes"]["crossfill.attempt"] for s in attempts] == [1, 2]
    first, second = attempts
    assert first["attributes"]["crossfill.outcome"] == "error" and first["status"]["status_code"] == "ERROR"
    assert "KV transfer failed" in first["attributes"]["crossfill.error"]
    assert second["attributes"]["crossfill.outcome"] == "ok" and second["status"]["status_code"] == "UNSET"
    assert first["attributes"]["crossfill.cache_id"] != second["attributes"]["crossfill.cache_id"]
    _check_attempt(first, children, ok=False)
    _check_attempt(second, children, ok=True)
    assert dec["attributes"]["crossfill.retries"] == 1


def test_the_collector_got_the_same_spans(traced: dict[str, Any], collector: _Collector) -> None:
    exported = collector.spans()
    for trace_id in (traced["given"], traced["retried"]["crossfill"]["trace_id"]):
        in_files = {(trace_id, s["context"]["span_id"][2:], s["name"], _inst(s))
                    for s in _trace(traced["spans"], trace_id)}
        assert in_files and in_files == {s for s in exported if s[0] == trace_id}


def test_no_span_holds_prompt_or_output_text(traced: dict[str, Any], collector: _Collector) -> None:
    words = [MARK, "memory bandwidth bound"]
    words += [t.strip() for t in (traced["plain"]["text"], traced["retried"]["text"]) if len(t.strip()) >= 8]
    for f in traced["files"]:
        text = f.read_text()
        assert not [w for w in words if w in text], f
    assert not [w for w in words for body in collector.bodies if w.encode() in body]
    assert {_inst(s) for s in traced["spans"]} >= SERVICES
