"""Mutual TLS on every hop of a real cluster: requests flow, strangers are refused, the WAN sees ciphertext.

One cluster with `security.tls.enabled` (certificates written by `crossfill up`'s start-up, as in a
deployment), auth off (the API keys are tested elsewhere). KV compression and KV encryption at rest
are off in these clusters, so TLS is the only thing between the raw KV tensors and the wire: the
capture test searches the bytes that crossed the emulated WAN for the prompt and for the KV, and a
control run without TLS, on the same capture path, shows the same search finds both when they are
there in the clear.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from serving.serving_cluster import Cluster, cluster_config, launch_cluster
from serving.serving_helpers import LONG, generate

from crossfill.config import CrossfillConfig, parse_config
from crossfill.engine.engine import EngineConfig, LLMEngine
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import LayerKVChunk
from crossfill.kv.tls import client_context, write_dev_pki
from crossfill.net.capture import decode_streams
from crossfill.security import paths
from crossfill.serving.connector import tls_contexts

pytestmark = pytest.mark.timeout(600)

WINDOW = 32  # bytes: any 32-byte run of a KV tensor found on the wire would be a leak


def _tls_on(doc: dict) -> None:
    doc["security"]["tls"] = {"enabled": True}
    _plain_kv(doc)


def _plain_kv(doc: dict) -> None:
    # TLS alone stands between the KV tensors and the wire: no codec, no encryption at rest.
    doc["security"]["kv_encryption"] = {"enabled": False}


NO_CODEC = {"compression_enabled": False}


@pytest.fixture(scope="module")
def tls_cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("tls"), edit=_tls_on, kv_cache=NO_CODEC) as c:
        yield c


def _services(c: Cluster) -> dict[str, str]:
    """Every listener between services, by name: the scheduler and each worker (direct, not via the WAN)."""
    return {i.name: i.url for i in c.cfg.instances() if i.role != "gateway"}


def _tls12(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A client context held to TLS 1.2, where the server checks the client certificate inside the
    handshake: a refusal is a handshake failure on the client's side, not a later read error."""
    ctx = client_context(ca, cert, key)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


# --------------------------------------------------------------------------- the cluster works


def test_services_talk_https_and_a_remote_request_succeeds(tls_cluster: Cluster) -> None:
    c = tls_cluster
    assert all(url.startswith("https://") for url in _services(c).values())
    d = paths.security_dir(c.cfg)
    assert (d / "ca.pem").is_file() and (d / "far-prefill-0.pem").is_file()  # written by the start-up
    prompt = "Request tls-e2e: " + LONG
    r = generate(c.url, prompt, "remote_required")
    assert r.status_code == 200, r.text
    info = r.json()["crossfill"]
    assert info["route"] == "remote" and info["prefill_instance"] == "far-prefill-0", info
    assert info["kv_wire_bytes"] > 0 and info["degradation_reason"] is None, info
    # The scheduler reaches every worker (its probes are mutual TLS too).
    view = httpx.get(c.cfg.scheduler_url() + "/v1/admin/cluster", timeout=5, **c.tls).json()
    assert all(i["healthy"] and i["ready"] for i in view["instances"].values())


# --------------------------------------------------------------------------- strangers are refused


def test_plaintext_http_to_a_service_is_refused(tls_cluster: Cluster) -> None:
    for name, url in _services(tls_cluster).items():
        plain = url.replace("https://", "http://")
        with pytest.raises(httpx.TransportError):
            httpx.get(plain + "/healthz", timeout=10, trust_env=False)
        # The same port answers a client with the operator certificate.
        assert httpx.get(url + "/healthz", timeout=10, trust_env=False, **tls_cluster.tls).status_code == 200, name


def test_a_client_without_a_certificate_is_refused(tls_cluster: Cluster) -> None:
    ca = paths.ca_path(tls_cluster.cfg)
    anonymous = _tls12(ca)  # trusts the cluster's CA, presents nothing
    for name, url in _services(tls_cluster).items():
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/healthz", timeout=10, trust_env=False, verify=anonymous)
        cert, key = paths.cert_paths(tls_cluster.cfg, paths.OPERATOR)
        assert httpx.get(url + "/healthz", timeout=10, trust_env=False,
                         verify=_tls12(ca, cert, key)).status_code == 200, name


def test_a_certificate_from_another_ca_is_refused_on_http_and_on_the_kv_port(
        tls_cluster: Cluster, tmp_path: Path) -> None:
    cfg = tls_cluster.cfg
    ca = paths.ca_path(cfg)
    rogue = write_dev_pki(tmp_path / "rogue")  # a well-formed certificate, signed by someone else's CA
    impostor = _tls12(ca, rogue["client_cert"], rogue["client_key"])
    for url in _services(tls_cluster).values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/healthz", timeout=10, trust_env=False, verify=impostor)
    # A client trusting only the other CA refuses the cluster's servers in turn (the server is checked too).
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(cfg.scheduler_url() + "/healthz", timeout=10, trust_env=False,
                  verify=client_context(rogue["ca"], rogue["client_cert"], rogue["client_key"]))

    decode = cfg.instance("here-decode-0")
    assert decode.kv_port is not None
    operator_cert, operator_key = paths.cert_paths(cfg, paths.OPERATOR)
    with socket.create_connection((decode.host, decode.kv_port), timeout=10) as raw:
        with pytest.raises(ssl.SSLError):
            impostor.wrap_socket(raw, server_hostname=decode.host)
    with socket.create_connection((decode.host, decode.kv_port), timeout=10) as raw:
        with pytest.raises(ssl.SSLError):
            _tls12(ca).wrap_socket(raw, server_hostname=decode.host)  # no certificate at all
    with socket.create_connection((decode.host, decode.kv_port), timeout=10) as raw:
        _tls12(ca, operator_cert, operator_key).wrap_socket(raw, server_hostname=decode.host).close()  # ours: in


# --------------------------------------------------------------------------- what the WAN sees


def _raw_kv(model: str, prompt: str) -> tuple[list[int], list[bytes]]:
    """The prompt's token ids (the gateway's tokenizer) and its KV as the prefill instance computes it
    (same model, dtype and thread count): every layer's K and V cut into WINDOW-byte pieces, what
    `kv_cache` without a codec puts on the wire."""
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine.from_model(model, EngineConfig(kv_memory_mb=16, max_num_seqs=8, num_threads=1))
        token_ids = engine.encode(prompt)
        chunks: list[LayerKVChunk] = []
        engine.add_request("kv", token_ids, SamplingParams(temperature=0, max_tokens=1), prefill_only=True,
                           kv_sink=chunks.append)
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.set_num_threads(threads)
    pieces = []
    for chunk in chunks:
        for t in (chunk.k, chunk.v):
            data = t.contiguous().numpy().tobytes()
            pieces += [data[i:i + WINDOW] for i in range(0, len(data) - WINDOW + 1, WINDOW)]
    return token_ids, pieces


def _captured_remote_request(c: Cluster, prompt: str) -> tuple[dict, list[bytes], list[bytes]]:
    """Send one remote-prefill request while both WAN crossings record; (route info, kv streams, http streams)."""
    controls = {"kv": c.emulator_control("here-decode-0", "kv"), "http": c.emulator_control("far-prefill-0", "http")}
    for url in controls.values():
        assert httpx.post(url + "/capture", json={}, timeout=5).status_code == 200
    try:
        r = generate(c.url, prompt, "remote_required", max_tokens=4)
        assert r.status_code == 200, r.text
        captured = {kind: httpx.get(url + "/capture", timeout=30).json() for kind, url in controls.items()}
    finally:
        for url in controls.values():
            httpx.delete(url + "/capture", timeout=5)
    for body in captured.values():
        assert not body["truncated"] and body["captured_bytes"] > 0
    return r.json()["crossfill"], decode_streams(captured["kv"]), decode_streams(captured["http"])


def _token_ids_json(ids: list[int]) -> list[bytes]:
    return [sep.join(str(t) for t in ids[:12]).encode() for sep in (",", ", ")]


def _found(needles: list[bytes], streams: list[bytes]) -> int:
    return sum(1 for n in needles if any(n in s for s in streams))


def test_the_wan_carries_neither_prompt_nor_kv_in_the_clear(tls_cluster: Cluster, tiny_llama_dir: Path,
                                                            tmp_path: Path) -> None:
    prompt = "Request capture-7f3a: the secret launch code is swordfish. " + LONG
    ids, kv = _raw_kv(str(tiny_llama_dir), prompt)
    assert len(kv) > 1000

    # Control: the same capture path without TLS finds the KV and the prompt (as token ids, the
    # form it crosses in: the gateway tokenizes in the local datacenter).
    with launch_cluster(str(tiny_llama_dir), tmp_path, edit=_plain_kv, kv_cache=NO_CODEC) as plain:
        info, kv_streams, http_streams = _captured_remote_request(plain, prompt)
    assert info["route"] == "remote" and info["kv_wire_bytes"] > 0
    found = _found(kv, kv_streams)
    assert found >= 0.9 * len(kv), f"only {found} of {len(kv)} KV windows crossed in the clear"
    assert _found(_token_ids_json(ids), http_streams) >= 1
    assert _found([b"/v1/prefill", b"prompt_token_ids"], http_streams) == 2

    info, kv_streams, http_streams = _captured_remote_request(tls_cluster, prompt)
    assert info["route"] == "remote" and info["kv_wire_bytes"] > 0
    everything = kv_streams + http_streams
    assert sum(map(len, kv_streams)) >= info["kv_wire_bytes"]  # the KV did cross here
    assert _found(kv, everything) == 0
    assert _found(_token_ids_json(ids), everything) == 0
    for text in (prompt.encode(), b"swordfish", b"capture-7f3a", json.dumps(prompt).encode()):
        assert _found([text], everything) == 0
    # Not even the HTTP framing shows: the control plane crossed as TLS records too.
    assert _found([b"HTTP/1.1", b"/v1/prefill", b"prompt_token_ids"], everything) == 0


# --------------------------------------------------------------------------- start-up and Mooncake


def _config_file(tmp_path: Path, model: Path, **kv: object) -> Path:
    doc = cluster_config(model, 31000, kv_cache=kv) if kv else cluster_config(model, 31000)
    doc["security"] = {"dir": str(tmp_path / "nothing-here"), "tls": {"enabled": True}, "auth": {"enabled": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_serve_alone_does_not_create_certificates_and_says_how(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = _config_file(tmp_path, tiny_llama_dir)
    out = subprocess.run([sys.executable, "-m", "crossfill.cli", "serve", "scheduler", "--config", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "security.dir" in out.stdout and "crossfill certs init" in out.stdout, out.stdout
    assert not (tmp_path / "nothing-here").exists()


def _cfg(tmp_path: Path, model: Path, **kv: object) -> CrossfillConfig:
    return parse_config(yaml.safe_load(_config_file(tmp_path, model, **kv).read_text()))


def test_kv_data_plane_uses_the_instance_certificate(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from crossfill.security.pki import init_security_dir

    cfg = _cfg(tmp_path, tiny_llama_dir)
    init_security_dir(cfg)
    server, client = tls_contexts(cfg, "here-decode-0")
    assert server is not None and client is not None and server.verify_mode == ssl.CERT_REQUIRED
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize("kv", [{"transport": "mooncake_te"},
                                {"transport": "store", "store": "mooncake", "mooncake_master": "127.0.0.1:50051"}])
def test_mooncake_keeps_its_own_transport_with_a_warning(tmp_path: Path, tiny_llama_dir: Path, kv: dict,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(tmp_path, tiny_llama_dir, **kv)  # security.tls.enabled does not refuse the config
    with caplog.at_level(logging.WARNING, logger="crossfill.connector"):
        assert tls_contexts(cfg, "here-decode-0") == (None, None)
    assert "Mooncake's own plaintext transport" in caplog.text
