"""A config document with every port of the topology moved by `offset`, so a bench's cluster runs
beside a `make serve` (or another bench) on the same machine. Shared by the benches that start the
example cluster through the `crossfill up` code path (reuse, security_ttft, observability_overhead)."""

from __future__ import annotations

from typing import Any


def shift_ports(doc: dict[str, Any], offset: int) -> dict[str, Any]:
    """Move the gateway's, scheduler's, every pool's HTTP and KV ports and every link emulator's by `offset`."""
    topo = doc["topology"]
    for ep in ("gateway", "scheduler"):
        topo[ep]["port"] += offset
    for dc in topo["datacenters"].values():
        for pool in ("prefill", "decode"):
            if dc.get(pool):
                for key in ("port", "kv_port"):
                    if dc[pool].get(key):
                        dc[pool][key] += offset
    for link in topo.get("links", []):
        link["emulator_port_base"] = link.get("emulator_port_base", 9500) + offset
    return doc
