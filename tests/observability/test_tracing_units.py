"""Tracing parts without a cluster: the process's tracer and file exporter, W3C propagation between
two processes' tracers, the request's trace_id, the manifest's optional traceparent, the config keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from serving.serving_cluster import cluster_config

from crossfill.config import ConfigError, parse_config
from crossfill.engine.types import LayerSpec
from crossfill.kv.errors import Reason, WireError
from crossfill.kv.wire import Manifest
from crossfill.observability.tracing import ManifestWatch, Tracing, end_span, trace_file_path


def _cfg(**observability: object):
    doc = cluster_config(Path("model"), 20000)
    doc["inference_service"]["observability"].update(observability)
    return parse_config(doc)


def _spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_trace_crosses_processes_through_traceparent_and_lands_in_each_file(tmp_path: Path) -> None:
    cfg = _cfg(trace_file=str(tmp_path / "spans.jsonl"))
    gateway, decode = Tracing(cfg, "gateway", "gateway", "here"), Tracing(cfg, "decode", "here-decode-0", "here")
    wanted = "4bf92f3577b34da6a3ce929d0e0e4736"
    root = gateway.start_root("gateway.request", headers={}, trace_id=wanted)
    headers = Tracing.headers(Tracing.context(root))
    assert headers["traceparent"].startswith(f"00-{wanted}-")
    child = decode.start("decode.request", decode.extract(headers))  # "another process": only the header crossed
    end_span(child, {"crossfill.route": "remote"}, error="kv_timeout")
    end_span(root)
    end_span(root)  # a second end is a no-op
    gateway.shutdown()
    decode.shutdown()
    (g,) = _spans(tmp_path / "spans.gateway.jsonl")
    (d,) = _spans(tmp_path / "spans.here-decode-0.jsonl")
    assert g["context"]["trace_id"] == d["context"]["trace_id"] == "0x" + wanted
    assert g["parent_id"] is None and d["parent_id"] == g["context"]["span_id"]
    assert d["resource"]["attributes"]["service.instance.id"] == "here-decode-0"
    assert d["status"]["status_code"] == "ERROR" and d["attributes"]["error.type"] == "kv_timeout"


@pytest.mark.parametrize("given", [None, "trace-abc", "0" * 32])
def test_a_trace_id_that_is_not_32_hex_digits_gets_a_fresh_trace(given: str | None) -> None:
    tracing = Tracing(_cfg(), "gateway", "gateway", "here")
    a = tracing.start_root("gateway.request", headers={}, trace_id=given)
    b = tracing.start_root("gateway.request", headers={}, trace_id=given)
    ids = {Tracing.trace_id(a), Tracing.trace_id(b)}
    assert len(ids) == 2 and all(i and len(i) == 32 and i != "0" * 32 for i in ids)


def test_a_client_traceparent_parents_the_root_unless_the_body_names_a_trace_id() -> None:
    tracing = Tracing(_cfg(), "gateway", "gateway", "here")
    upstream = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    root = tracing.start_root("gateway.request", headers={"traceparent": upstream}, trace_id=None)
    assert Tracing.trace_id(root) == "0af7651916cd43dd8448eb211c80319c"
    wanted = "1" * 32
    assert Tracing.trace_id(tracing.start_root("x", headers={"traceparent": upstream}, trace_id=wanted)) == wanted


def test_tracing_off_makes_no_ids_no_headers_and_no_files(tmp_path: Path) -> None:
    tracing = Tracing(_cfg(tracing_enabled=False, trace_file=str(tmp_path / "t.jsonl")), "gateway", "gateway", "here")
    span = tracing.start_root("gateway.request", headers={}, trace_id=None)
    assert Tracing.trace_id(span) is None and Tracing.headers(Tracing.context(span)) == {}
    assert Tracing.traceparent(span) is None
    assert tracing.extract({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}) is None
    tracing.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_trace_file_is_one_file_per_process() -> None:
    assert trace_file_path("/var/log/crossfill/traces.jsonl", "far-prefill-0") == \
        Path("/var/log/crossfill/traces.far-prefill-0.jsonl")
    assert trace_file_path("spans", "gateway") == Path("spans.gateway")


def _manifest(**kw: object) -> Manifest:
    specs = [LayerSpec(index=0, kind="full", window=None, num_kv_heads=2, head_dim=8, dtype=torch.float32)]
    return Manifest.build(cache_id="c-1", request_id="r-1", tenant="acme", fingerprint="f", token_ids=list(range(40)),
                          layer_specs=specs, frame_tokens=16, **kw)  # type: ignore[arg-type]


def test_manifest_traceparent_is_optional_and_round_trips() -> None:
    plain = json.loads(_manifest().to_json())
    assert "traceparent" not in plain  # without tracing, the bytes are those of a manifest before the field
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    m = _manifest(traceparent=tp)
    again = Manifest.from_json(m.to_json())
    assert again.traceparent == tp and again == m
    with pytest.raises(WireError) as err:
        Manifest.from_json(_manifest(ticket=None).to_json().replace(b'"version"', b'"traceparent":"' + b"x" * 300
                                                                     + b'","version"'))
    assert err.value.reason == Reason.MALFORMED and "traceparent" in str(err.value)


def test_manifest_watch_notes_only_a_manifest_the_real_check_accepted() -> None:
    def refuse(_: object) -> None:
        raise WireError(Reason.TICKET, "forged")

    watch = ManifestWatch(refuse)
    with pytest.raises(WireError):
        watch(_manifest(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))
    assert watch.arrived_ns is None and watch.traceparent is None
    ok = ManifestWatch(None)
    ok(_manifest(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))
    assert ok.arrived_ns is not None and ok.traceparent.startswith("00-0af7")  # type: ignore[union-attr]


def test_otlp_endpoint_must_be_an_http_url() -> None:
    with pytest.raises(ConfigError, match=r"inference_service\.observability\.otlp_endpoint: .*http"):
        _cfg(otlp_endpoint="collector:4318")
    assert _cfg(otlp_endpoint="http://collector:4318").inference_service.observability.otlp_endpoint
