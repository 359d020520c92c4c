"""The configuration file: the seed's block, the topology, and errors that name the key path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crossfill.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
SEED_BLOCK = """
inference_service:
  mode: "prefill_decode_disaggregated"
  routing: {long_context_threshold_tokens: 16384, prefer_remote_prefill: true, fallback_to_local_on_failure: true}
  prefill_pool: {replicas: 4, resource_class: "high_compute", max_queue_depth: 64, warmup_before_serving: true}
  decode_pool: {replicas: 8, resource_class: "high_bandwidth", max_concurrent_requests: 128}
  kv_cache: {compression_enabled: true, compression_mode: "hybrid_attention", checksum_enabled: true, timeout_ms: 8000, max_retry: 2}
  network: {min_bandwidth_gbps: 40, max_latency_ms: 10, isolated_transport_queue: true}
  observability: {metrics_enabled: true, tracing_enabled: true, log_level: "info"}
"""
TOPOLOGY = {
    "local_datacenter": "near",
    "gateway": {"port": 18000},
    "scheduler": {"port": 18001},
    "datacenters": {
        "near": {"prefill": {"port": 18100}, "decode": {"port": 18200, "kv_port": 19200}},
        "far": {"prefill": {"port": 18300}},
    },
    "links": [{"between": ["far", "near"], "bandwidth_gbps": 1, "latency_ms": 20}],
}


def seed_doc() -> dict:
    doc = yaml.safe_load(SEED_BLOCK)
    doc["topology"] = yaml.safe_load(yaml.safe_dump(TOPOLOGY))
    return doc


def test_seed_block_verbatim_is_accepted_and_replicas_place_instances() -> None:
    cfg = parse_config(seed_doc())
    svc = cfg.inference_service
    assert svc.kv_cache.timeout_ms == 8000 and svc.network.min_bandwidth_gbps == 40
    roles = [i.role for i in cfg.instances()]
    # replicas applies per datacenter hosting the pool: 4 prefill in each of two DCs, 8 decode.
    assert roles.count("prefill") == 8 and roles.count("decode") == 8
    assert [i.port for i in cfg.decode_instances()] == list(range(18200, 18208))


def test_examples_are_valid() -> None:
    for name in ("two-dc.yaml", "two-dc-gemma3.yaml"):
        cfg = load_config(ROOT / "examples" / name)
        assert cfg.topology.gateway.port == 8000
        link = cfg.link_to_local("dc-remote")
        assert link is not None and (link.bandwidth_gbps, link.latency_ms) == (1.0, 20)
        # A remote prefill reaches decode's KV port and is reached itself through the emulator.
        assert cfg.kv_address("dc-local-decode-0", "dc-remote")[1] != cfg.instance("dc-local-decode-0").kv_port
        assert cfg.kv_address("dc-local-decode-0", "dc-local")[1] == cfg.instance("dc-local-decode-0").kv_port


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("inference_service", "routing", "long_context_threshold_tokens"), "long",
         "inference_service.routing.long_context_threshold_tokens: expected an integer, got 'long'"),
        (("inference_service", "kv_cache", "checksum_enabled"), "yes please",
         "inference_service.kv_cache.checksum_enabled: expected a boolean"),
        (("inference_service", "mode"), "mixed", "inference_service.mode: expected one of"),
        (("inference_service", "prefill_pool", "max_queue_depth"), 0,
         "inference_service.prefill_pool.max_queue_depth: Input should be greater than or equal to 1"),
        (("inference_service", "routing", "long_context_treshold"), 5,
         "inference_service.routing.long_context_treshold: unknown key"),
        (("topology", "datacenters", "near", "decode", "port"), "8200",
         "topology.datacenters.near.decode.port: expected an integer"),
    ],
)
def test_bad_values_name_the_key_path_and_expected_type(path: tuple, value: object, message: str) -> None:
    doc = seed_doc()
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert message in str(e.value)


def test_cross_checks() -> None:
    doc = seed_doc()
    doc["inference_service"]["prefill_pool"]["resource_class"] = "gpu_xl"
    with pytest.raises(ConfigError, match="resource_class: 'gpu_xl' is not defined"):
        parse_config(doc)
    doc = seed_doc()
    doc["topology"]["links"] = []
    with pytest.raises(ConfigError, match="topology.datacenters.far: no entry in topology.links"):
        parse_config(doc)
    doc = seed_doc()
    doc["topology"]["scheduler"]["port"] = 18100
    with pytest.raises(ConfigError, match="18100 is already used"):
        parse_config(doc)


def test_config_check_cli(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "crossfill.cli", "config", "check", str(ROOT / "examples/two-dc.yaml")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "dc-remote-prefill-0" in ok.stdout and "link emulator" in ok.stdout
    assert ("security: API keys (1 dev key(s)); mutual TLS from .crossfill/security; transfer tickets "
            "(ttl 120 s); KV at rest AES-GCM; audit in .crossfill/audit") in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("inference_service:\n  kv_cache: {timeout_ms: soon}\ntopology: {}\n")
    out = subprocess.run([sys.executable, "-m", "crossfill.cli", "config", "check", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "inference_service.kv_cache.timeout_ms: expected an integer, got 'soon'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("codec,lossy", [("lz4", False), ("none", False), ("int8", True), ("fp8+zstd", True)])
def test_lossy_kv_imports_get_their_own_prefix_cache_namespace(codec: str, lossy: bool) -> None:
    """Decode publishes imported KV to its prefix cache; approximated KV must not serve as exact KV."""
    from crossfill.serving.connector import import_namespace

    doc = seed_doc()
    doc["inference_service"]["kv_cache"]["codec"] = codec
    cfg = parse_config(doc)
    ns = import_namespace(cfg, "tenant-a")
    assert (ns != "tenant-a") is lossy
    if lossy:
        assert ns.startswith("tenant-a") and codec in ns


@pytest.mark.parametrize("kv,message", [
    ({"transport": "carrier-pigeon"}, "inference_service.kv_cache.transport: expected one of 'tcp', 'mooncake_te' or 'store'"),
    ({"transport": "store", "store": "tape"}, "inference_service.kv_cache.store: expected one of 'embedded' or 'mooncake'"),
    ({"transport": "store", "store": "mooncake"}, "inference_service.kv_cache.mooncake_master: required"),
    ({"transport": "store", "store": "mooncake", "mooncake_master": "nowhere"},
     "inference_service.kv_cache.mooncake_master: expected \"host:port\""),
    ({"tls": {"cert_file": "/no/such.pem", "key_file": "/no/such.key", "ca_file": "/no/ca.pem"}},
     "inference_service.kv_cache.tls.cert_file: cannot read '/no/such.pem'"),
    ({"tls": {"cert_file": "x"}}, "inference_service.kv_cache.tls.key_file: required key is missing"),
])
def test_bad_transport_settings_name_the_key(kv: dict, message: str) -> None:
    doc = seed_doc()
    doc["inference_service"]["kv_cache"].update(kv)
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert message in str(err.value)


def test_tls_is_refused_where_mooncake_carries_the_bytes(tmp_path: Path) -> None:
    from crossfill.kv.tls import write_dev_pki

    pki = write_dev_pki(tmp_path)
    tls = {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]), "ca_file": str(pki["ca"])}
    doc = seed_doc()
    doc["inference_service"]["kv_cache"].update({"transport": "tcp", "tls": tls})
    assert parse_config(doc).inference_service.kv_cache.tls is not None
    doc["inference_service"]["kv_cache"]["transport"] = "mooncake_te"
    with pytest.raises(ConfigError, match="kv_cache.tls: Mooncake Transfer Engine moves KV bytes"):
        parse_config(doc)


def test_every_example_config_is_valid(tmp_path: Path) -> None:
    from crossfill.kv.tls import write_dev_pki

    write_dev_pki(tmp_path / ".pki")  # examples/two-dc-tls.yaml names .pki/ in the working directory
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        out = subprocess.run([sys.executable, "-m", "crossfill.cli", "config", "check", str(path)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, (path.name, out.stderr)


def test_worker_with_an_unreachable_store_exits_naming_the_key(tmp_path: Path) -> None:
    """A store that is not reachable at start stops the worker before it serves (and so `crossfill up`)."""
    import socket

    from crossfill.security.paths import ensure_symmetric_keys

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    doc = seed_doc()
    doc["inference_service"]["kv_cache"].update({"transport": "store", "store": "mooncake",
                                                 "mooncake_master": f"127.0.0.1:{dead}"})
    # The ticket and KV keys exist and TLS is off, so the store is the one thing missing.
    ensure_symmetric_keys(tmp_path / "sec")
    doc["security"] = {"dir": str(tmp_path / "sec"), "audit_dir": None, "tls": {"enabled": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    name = next(i.name for i in parse_config(doc).instances() if i.role == "decode")
    out = subprocess.run([sys.executable, "-m", "crossfill.cli", "serve", "decode", "--config", str(path),
                          "--instance", name], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"inference_service.kv_cache.mooncake_master: nothing answers at 127.0.0.1:{dead}" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize("routing, message", [
    ({"cost_weights": {"far": -1}}, "inference_service.routing.cost_weights.far: a cost weight must be >= 0"),
    ({"cost_weights": {"mars": 1}}, "inference_service.routing.cost_weights.mars: unknown datacenter"),
    ({"tenants": {"acme": {"tier": "gold"}}}, "inference_service.routing.tenants.acme.tier: expected one of"),
    ({"tenants": {"acme": {"request_type": "bulk"}}},
     "inference_service.routing.tenants.acme.request_type: expected one of"),
    ({"tenants": {"acme": {"weight": 0}}}, "inference_service.routing.tenants.acme.weight"),
    ({"batch_capacity_share": 0}, "inference_service.routing.batch_capacity_share"),
    ({"egress_budget_bytes_per_s": -5}, "inference_service.routing.egress_budget_bytes_per_s"),
])
def test_routing_v2_bad_values_name_the_key(routing: dict, message: str) -> None:
    doc = seed_doc()
    doc["inference_service"]["routing"].update(routing)
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert message in str(e.value), str(e.value)
