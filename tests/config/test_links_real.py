"""`emulate: false` on a link: a real network between datacenters, no WAN emulator in the path.

Every address one datacenter uses for another (`kv_address`, `http_url`) must then be the
instance's own host and port, since nothing listens on the emulator's ports; other links of the
same file keep their emulators.
"""

from __future__ import annotations

import pytest

from crossfill.config import ConfigError, CrossfillConfig, parse_config

NEAR, FAR, LAB = "10.77.0.1", "10.77.0.2", "10.77.0.3"


def _doc(far_link: dict, lab_link: dict | None = None) -> dict:
    """A local DC "near" (decode + prefill), a remote "far", and optionally a remote "lab"."""
    datacenters: dict = {
        "near": {"host": NEAR, "prefill": {"port": 8100}, "decode": {"port": 8200, "kv_port": 9200}},
        "far": {"host": FAR, "prefill": {"port": 8300}},
    }
    links = [{"between": ["far", "near"], "bandwidth_gbps": 10, "latency_ms": 3, **far_link}]
    if lab_link is not None:
        datacenters["lab"] = {"host": LAB, "prefill": {"port": 8400}}
        links.append({"between": ["lab", "near"], "bandwidth_gbps": 1, "latency_ms": 20, **lab_link})
    return {
        "inference_service": {"prefill_pool": {"replicas": 1}, "decode_pool": {"replicas": 2}},
        "topology": {"local_datacenter": "near", "gateway": {"host": NEAR, "port": 8000},
                     "scheduler": {"host": NEAR, "port": 8001}, "datacenters": datacenters, "links": links},
    }


def _direct_kv(cfg: CrossfillConfig, decode: str) -> tuple[str, int | None]:
    inst = cfg.instance(decode)
    return inst.host, inst.kv_port


def test_emulate_false_validates_and_defaults_to_true() -> None:
    assert parse_config(_doc({})).topology.links[0].emulate is True
    assert parse_config(_doc({"emulate": False})).topology.links[0].emulate is False
    with pytest.raises(ConfigError, match=r"topology\.links\.0\.emulate: expected a boolean"):
        parse_config(_doc({"emulate": "no"}))


def test_a_real_link_has_no_crossings_and_every_address_is_direct() -> None:
    cfg = parse_config(_doc({"emulate": False}))
    assert cfg.crossings() == []  # so `crossfill up` starts no emulator process at all
    for decode in ("near-decode-0", "near-decode-1"):
        assert cfg.kv_address(decode, "far") == _direct_kv(cfg, decode)
        assert cfg.kv_address(decode, "far")[0] == NEAR
    # Between datacenters over a real network: mutual TLS (security.tls, on by default).
    assert cfg.http_url("far-prefill-0") == f"https://{FAR}:8300"
    assert cfg.http_url("near-decode-1") == f"https://{NEAR}:8201"


def test_only_the_emulated_link_gets_emulators_in_a_mixed_topology() -> None:
    cfg = parse_config(_doc({"emulate": False}, {"emulate": True, "emulator_port_base": 9500}))
    crossings = cfg.crossings()
    assert crossings and {c.remote_dc for c in crossings} == {"lab"}
    assert {c.link_index for c in crossings} == {1}
    # far reaches decode and is reached directly; lab goes through its emulator on the local machine.
    assert cfg.kv_address("near-decode-0", "far") == _direct_kv(cfg, "near-decode-0")
    lab_kv = cfg.kv_address("near-decode-0", "lab")
    assert lab_kv != _direct_kv(cfg, "near-decode-0") and 9500 <= lab_kv[1] < 9600
    assert cfg.http_url("far-prefill-0") == f"https://{FAR}:8300"
    assert cfg.http_url("lab-prefill-0") != f"https://{LAB}:8400"
