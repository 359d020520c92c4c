"""The simulation file: a planner cluster file (`crossfill plan --profile` reads the same file) plus
what a simulation needs beyond capacity: the model's KV, arrivals, caches, link dynamics,
failures, the routing config and SLOs. `crossfill/sim/examples/prfaas-case-study.yaml` documents
every key.

Planner keys (parsed by the planner's own code): `prefill`, `pools.{remote,local}.{instances,
prefill}`, `decode`, `link.gbps`, `workload`. Simulator keys: `model`, `arrival`, `output`,
`prefix_sharing`, `sessions`, `request_mix`, `failures`, `prefix_cache`, `routing` (or a whole
`inference_service` block, validated by the live config schema), `gateway`, `slo`, `simulation`,
and `pools.*.hardware`, `pools.local.prefill_instances`, `decode.max_batch`, `link.rtt_ms`,
`link.fluctuation`, `link.outages`.

Like the live config, everything is strict: an unknown key, a wrong type or an impossible value
raises `SimError` naming the key path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from crossfill.config import ConfigError, InferenceServiceConfig
from crossfill.planner import cluster_file
from crossfill.planner.errors import PlanError
from crossfill.planner.optimizer import ClusterSetup
from crossfill.planner.profiles import DecodeProfile, read_yaml
from crossfill.planner.workload import EmpiricalWorkload, Workload, parse_workload_spec
from crossfill.sim.costs import DecodeSteps, KVCost, PrefillTime
from crossfill.sim.errors import SimError
from crossfill.sim.fields import mapping, number, whole
from crossfill.sim.link import LinkSpec
from crossfill.sim.sections import (
    Failures,
    Slo,
    distribution,
    failures,
    kv_cost,
    link_spec,
    service_config,
    slo,
)
from crossfill.sim.workload import (
    ARRIVAL_PROCESSES,
    Arrival,
    Lengths,
    PrefixSharing,
    Requests,
    Sessions,
    WorkloadSpec,
)

STRATEGY_NAMES = ("homogeneous-pd", "naive-remote", "threshold-only", "full-policy")
_TOP_KEYS = {"prefill", "pools", "decode", "link", "workload", "model", "arrival", "output", "prefix_sharing",
             "sessions", "request_mix", "failures", "prefix_cache", "routing", "inference_service", "gateway", "slo",
             "simulation"}


@dataclass(frozen=True)
class SimSpec:
    source: str
    setup: ClusterSetup  # the planner's view of the same cluster (optimizer, analytic capacities)
    remote_time: PrefillTime
    local_time: PrefillTime
    remote_hardware: str
    local_hardware: str
    local_prefill_instances: int | None  # pinned split; None: the optimizer's
    decode: DecodeSteps
    decode_capacity: int  # decode_pool.max_concurrent_requests
    kv: KVCost
    link: LinkSpec
    workload: WorkloadSpec
    failures: Failures
    prefill_cache_tokens: int
    decode_cache_tokens: int
    config: InferenceServiceConfig
    retry_after_s: float
    retry_budget_s: float
    slo: Slo
    requests: int
    seed: int
    candidates_k: int
    exact_below: int
    drain_s: float
    strategies: tuple[str, ...]

    def prefill_tokens_per_s(self, remote: bool) -> float:
        """The speed the live scheduler would have measured: throughput at the mean prompt."""
        mean = self.setup.workload.mean()
        return (self.remote_time if remote else self.local_time).tokens_per_s(mean)


@dataclass(frozen=True)
class Overrides:
    """Command-line flags that replace file values."""

    lengths: str | None = None  # --workload: a length distribution spec, as `plan --lengths`
    rate: float | None = None
    requests: int | None = None
    seed: int | None = None
    scale: float | None = None  # multiply every pool, the arrival rate and the link bandwidth
    strategies: tuple[str, ...] | None = None
    candidates: int | None = None


def read_file(path: str | Path) -> dict[str, Any]:
    return read_yaml(path, "--config", "a simulation YAML file", SimError)


def load_spec(path: str | Path, overrides: Overrides = Overrides(), trace: Requests | None = None) -> SimSpec:
    data = read_file(path)
    try:
        return parse_spec(data, str(path), overrides, trace)
    except (PlanError, ConfigError) as exc:
        raise SimError(str(exc)) from None


def parse_spec(data: dict[str, Any], source: str, overrides: Overrides = Overrides(),
               trace: Requests | None = None) -> SimSpec:
    data = copy.deepcopy(data)
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise SimError(f"{unknown[0]}: unknown key; expected some of {sorted(_TOP_KEYS)}")
    if overrides.scale is not None:
        _scale(data, overrides.scale)
    pools = mapping(data.get("pools"), "pools", {"remote", "local"}, required=True)
    remote = mapping(pools.get("remote"), "pools.remote", {"instances", "prefill", "hardware"}, required=True)
    local = mapping(pools.get("local"), "pools.local", {"instances", "prefill", "hardware", "prefill_instances"},
                     required=True)
    link = link_spec(data)
    kv = kv_cost(data.get("model"))
    workload = _lengths_workload(data, overrides, trace)
    decode_block = mapping(data.get("decode"), "decode", {"batch", "tpot_ms", "slo_ms", "output_len",
                                                           "kv_capacity_gb", "max_batch"}, required=True)
    setup = cluster_file.cluster_setup(data, kv.vectorised, prefill_override=None, workload=workload,
                                       link_gbps=link.gbps)
    output = _output(data.get("output"), setup.decode)
    # Decode memory holds the KV decompressed (raw bytes) at prompt + output length.
    out_mean = output.mean()
    mean_kv = workload.expect(lambda lengths: kv.vectorised(lengths + out_mean)) * kv.codec_ratio
    max_batch = setup.decode.max_batch(mean_kv)
    if decode_block.get("max_batch") is not None:
        max_batch = whole(decode_block, "max_batch", "decode", ge=1)
    local_prefill = None
    if local.get("prefill_instances") is not None:
        local_prefill = whole(local, "prefill_instances", "pools.local", ge=0)
        if local_prefill >= setup.local_instances:
            raise SimError(f"pools.local.prefill_instances: {local_prefill} must be below pools.local.instances "
                           f"({setup.local_instances}) so at least one local instance decodes")
    sim = mapping(data.get("simulation"), "simulation", {"requests", "seed", "candidates_per_pool",
                                                           "exact_pool_size", "drain_s", "strategies"})
    config = service_config(data, link, max_batch)
    strategies = overrides.strategies or tuple(sim.get("strategies") or STRATEGY_NAMES)
    for i, name in enumerate(strategies):
        if name not in STRATEGY_NAMES:
            where = "--strategies" if overrides.strategies else f"simulation.strategies[{i}]"
            raise SimError(f"{where}: unknown strategy {name!r}; expected some of {list(STRATEGY_NAMES)}")
    gateway = mapping(data.get("gateway"), "gateway", {"retry_after_s", "retry_budget_s"})
    cache = mapping(data.get("prefix_cache"), "prefix_cache", {"prefill_tokens", "decode_tokens"})
    requests = overrides.requests if overrides.requests is not None else whole(sim, "requests", "simulation", ge=1,
                                                                                default=20000)
    if requests < 1:
        raise SimError(f"--requests: {requests} must be >= 1")
    candidates = overrides.candidates if overrides.candidates is not None else whole(
        sim, "candidates_per_pool", "simulation", ge=1, default=4)
    if candidates < 1:
        raise SimError(f"--candidates: {candidates} must be >= 1")
    return SimSpec(
        source=source,
        setup=setup,
        remote_time=PrefillTime(setup.remote_prefill),
        local_time=PrefillTime(setup.local_prefill),
        remote_hardware=str(remote.get("hardware", "remote class")),
        local_hardware=str(local.get("hardware", "local class")),
        local_prefill_instances=local_prefill,
        decode=DecodeSteps(setup.decode, max_batch),
        decode_capacity=config.decode_pool.max_concurrent_requests,
        kv=kv,
        link=link,
        workload=_workload_spec(data, overrides, workload, output),
        failures=failures(data.get("failures")),
        prefill_cache_tokens=whole(cache, "prefill_tokens", "prefix_cache", ge=0, default=1_000_000),
        decode_cache_tokens=whole(cache, "decode_tokens", "prefix_cache", ge=0, default=1_000_000),
        config=config,
        retry_after_s=number(gateway, "retry_after_s", "gateway", gt=0, default=1.0),
        retry_budget_s=number(gateway, "retry_budget_s", "gateway", ge=0, default=20.0),
        slo=slo(data.get("slo"), setup.decode),
        requests=requests,
        seed=overrides.seed if overrides.seed is not None else whole(sim, "seed", "simulation", ge=0, default=0),
        candidates_k=candidates,
        exact_below=whole(sim, "exact_pool_size", "simulation", ge=0, default=16),
        drain_s=number(sim, "drain_s", "simulation", gt=0, default=3600.0),
        strategies=tuple(strategies),
    )


# --------------------------------------------------------------------------- sections


def _scale(data: dict[str, Any], factor: float) -> None:
    if not factor > 0:
        raise SimError(f"--scale: {factor:g} must be > 0")
    pools = data.get("pools") or {}
    for name in ("remote", "local"):
        pool = pools.get(name)
        if isinstance(pool, dict):
            for key in ("instances", "prefill_instances"):
                if isinstance(pool.get(key), int) and not isinstance(pool.get(key), bool):
                    pool[key] = max(1 if key == "instances" and pool[key] > 0 else 0, round(pool[key] * factor))
    # Rate and link grow with the pools: a cluster N times bigger, not the same link N times busier.
    for block, key in (("arrival", "rate"), ("link", "gbps")):
        section = data.get(block)
        if isinstance(section, dict) and isinstance(section.get(key), int | float):
            section[key] = section[key] * factor


def _lengths_workload(data: dict[str, Any], overrides: Overrides, trace: Requests | None) -> Workload:
    """Prompt lengths: the trace's, else --workload, else the file's `workload`."""
    if trace is not None:
        return EmpiricalWorkload(trace.prompt, source=trace.source)
    if overrides.lengths:
        return parse_workload_spec(overrides.lengths)
    raw = data.get("workload")
    if raw is None:
        raise SimError("workload: missing; expected {lognormal: {median, sigma, min, max}} or {empirical: PATH}, "
                       "or give --workload or --trace")
    lengths = distribution(raw, "workload")
    if lengths.dist is None:  # every prompt the same length
        return EmpiricalWorkload(np.asarray([float(lengths.fixed or 1)]), source="workload.fixed")
    return lengths.dist


def _output(raw: Any, decode: DecodeProfile) -> Lengths:
    if raw is None:
        return Lengths(fixed=max(1, round(decode.output_len)))
    return distribution(raw, "output")


def _workload_spec(data: dict[str, Any], overrides: Overrides, lengths: Workload, output: Lengths) -> WorkloadSpec:
    arr = mapping(data.get("arrival"), "arrival", {"process", "rate", "cv"}, required=True)
    process = arr.get("process", "poisson")
    if process not in ARRIVAL_PROCESSES:
        raise SimError(f"arrival.process: {process!r} is unknown; expected one of {list(ARRIVAL_PROCESSES)}")
    rate = overrides.rate if overrides.rate is not None else number(arr, "rate", "arrival")
    if not rate > 0:
        raise SimError(f"{'--rate' if overrides.rate is not None else 'arrival.rate'}: {rate:g} must be > 0 requests/s")
    cv = number(arr, "cv", "arrival", gt=0, default=1.0)
    prefix = None
    if data.get("prefix_sharing") is not None:
        p = mapping(data["prefix_sharing"], "prefix_sharing", {"share", "prefixes", "tokens"}, required=True)
        prefix = PrefixSharing(number(p, "share", "prefix_sharing", ge=0, le=1),
                               whole(p, "prefixes", "prefix_sharing", ge=1), whole(p, "tokens", "prefix_sharing", ge=1))
    sessions = None
    if data.get("sessions") is not None:
        s = mapping(data["sessions"], "sessions", {"share", "turns", "think_s", "new_tokens"}, required=True)
        sessions = Sessions(number(s, "share", "sessions", ge=0, le=1), whole(s, "turns", "sessions", ge=2),
                            number(s, "think_s", "sessions", gt=0, default=30.0),
                            whole(s, "new_tokens", "sessions", ge=1, default=256))
    mix = mapping(data.get("request_mix"), "request_mix", {"batch_share", "tenants"})
    tenants_raw = mapping(mix.get("tenants"), "request_mix.tenants", None)
    tenants = tuple((str(k), number(tenants_raw, k, "request_mix.tenants", ge=0, le=1)) for k in tenants_raw)
    if sum(s for _, s in tenants) > 1 + 1e-9:
        raise SimError("request_mix.tenants: the shares add up to more than 1")
    return WorkloadSpec(Arrival(process, rate, cv), Lengths(dist=lengths), output, prefix, sessions,
                        number(mix, "batch_share", "request_mix", ge=0, le=1, default=0.0), tenants)


def with_rate(spec: SimSpec, rate: float) -> SimSpec:
    """The same simulation at another arrival rate (used by --search-rate)."""
    w = spec.workload
    return replace(spec, workload=replace(w, arrival=replace(w.arrival, rate=rate)))
