"""The cluster half of a `--profile` YAML: pools, decode profile, link and workload.

```yaml
prefill: {tps: 12000}                      # default prefill profile (or lengths/seconds lists)
pools:
  remote: {instances: 4, prefill: {lengths: [1024, 8192, 32768], seconds: [0.06, 0.5, 2.6]}}
  local:  {instances: 12}                  # split between local prefill and decode
decode: {batch: [1, 32, 64, 128], tpot_ms: [18, 22, 28, 40], slo_ms: 30, output_len: 512}
link: {gbps: 100}
workload: {lognormal: {median: 8192, sigma: 1.2, min: 128, max: 131072}}
```
Command-line flags (--prefill-tps, --link-gbps, --lengths) override the file.
"""

from __future__ import annotations

from typing import Any

from crossfill.planner.errors import PlanError
from crossfill.planner.optimizer import ClusterSetup
from crossfill.planner.profiles import DecodeProfile, PrefillProfile
from crossfill.planner.workload import LengthFn, Workload, workload_from_mapping


def default_prefill(data: dict[str, Any]) -> PrefillProfile | None:
    """The file's top-level ``prefill`` profile, else the remote pool's, else none."""
    if data.get("prefill") is not None:
        return PrefillProfile.from_mapping(data["prefill"], "prefill")
    remote = (data.get("pools") or {}).get("remote") or {}
    if isinstance(remote, dict) and remote.get("prefill") is not None:
        return PrefillProfile.from_mapping(remote["prefill"], "pools.remote.prefill")
    return None


def file_workload(data: dict[str, Any]) -> Workload | None:
    return workload_from_mapping(data["workload"]) if data.get("workload") is not None else None


def file_link_gbps(data: dict[str, Any]) -> float | None:
    link = data.get("link")
    if link is None:
        return None
    if not isinstance(link, dict) or "gbps" not in link:
        raise PlanError("link: expected a mapping with 'gbps'")
    try:
        gbps = float(link["gbps"])
    except (TypeError, ValueError) as exc:
        raise PlanError(f"link.gbps: {link['gbps']!r} is not a number of Gbps") from exc
    if not gbps > 0:
        raise PlanError(f"link.gbps: {gbps:g} must be > 0 Gbps")
    return gbps


def file_remote_instances(data: dict[str, Any]) -> int | None:
    """``pools.remote.instances`` if the file has it (the N of plain `plan`)."""
    pools = data.get("pools")
    if not isinstance(pools, dict) or pools.get("remote") is None:
        return None
    return _instances(pools["remote"], "pools.remote")


def _instances(pool: Any, field: str) -> int:
    if not isinstance(pool, dict) or "instances" not in pool:
        raise PlanError(f"{field}.instances: missing; expected a whole number of instances")
    value = pool["instances"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"{field}.instances: {value!r}; expected a whole number >= 0")
    return value


def cluster_setup(
    data: dict[str, Any],
    kv_bytes: LengthFn,
    *,
    prefill_override: PrefillProfile | None,
    workload: Workload | None,
    link_gbps: float | None,
) -> ClusterSetup:
    """Everything `--optimize` needs, from the profile file plus the command-line overrides.

    A prefill profile from the command line (--prefill-tps, --calibrate) applies to both pools;
    otherwise each pool uses its own ``prefill`` and falls back to the file's top-level one.
    """
    pools = data.get("pools")
    if not isinstance(pools, dict):
        raise PlanError("pools: missing; expected 'pools: {remote: {instances: N}, local: {instances: M}}'")
    remote, local = pools.get("remote"), pools.get("local")

    def pool_prefill(pool: Any, field: str) -> PrefillProfile:
        if prefill_override is not None:
            return prefill_override
        if isinstance(pool, dict) and pool.get("prefill") is not None:
            return PrefillProfile.from_mapping(pool["prefill"], f"{field}.prefill")
        if data.get("prefill") is not None:
            return PrefillProfile.from_mapping(data["prefill"], "prefill")
        raise PlanError(f"{field}.prefill: missing; give it, a top-level 'prefill', --prefill-tps or --calibrate")

    if "decode" not in data:
        raise PlanError("decode: missing; expected {batch, tpot_ms, slo_ms, output_len}")
    if workload is None:
        raise PlanError("workload: missing; give 'workload:' in the profile or --lengths")
    if link_gbps is None:
        raise PlanError("link.gbps: missing; give 'link: {gbps: X}' in the profile or --link-gbps")
    return ClusterSetup(
        workload=workload,
        remote_prefill=pool_prefill(remote, "pools.remote"),
        local_prefill=pool_prefill(local, "pools.local"),
        decode=DecodeProfile.from_mapping(data["decode"]),
        remote_instances=_instances(remote, "pools.remote"),
        local_instances=_instances(local, "pools.local"),
        link_gbps=link_gbps,
        kv_bytes=kv_bytes,
    )
