"""Parsers of the simulation file's sections beyond the planner's: the link's dynamics, the
model's KV, length distributions, failures, SLOs and the routing config (validated by the live
schema). `simfile` puts them together."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from crossfill.config import InferenceServiceConfig, _format_error
from crossfill.planner import cluster_file
from crossfill.planner.dtypes import kv_dtype
from crossfill.planner.model_source import load_model
from crossfill.planner.profiles import DecodeProfile
from crossfill.planner.workload import LogNormalWorkload, workload_from_mapping
from crossfill.sim.costs import KVCost
from crossfill.sim.errors import SimError
from crossfill.sim.fields import mapping, number, whole
from crossfill.sim.link import Fluctuation, LinkSpec
from crossfill.sim.snapshot import LOCAL_DC, REMOTE_DC
from crossfill.sim.workload import Lengths


@dataclass(frozen=True)
class Failures:
    remote_crash_per_hour: float = 0.0  # per remote prefill instance
    repair_s: float = 60.0
    transfer_failure_prob: float = 0.0  # per transfer attempt (checksum mismatch, broken stream)


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 10.0
    ttft_s_per_1k_tokens: float = 0.0  # long prompts may take longer: budget = ttft_s + this x prompt/1000
    tpot_s: float = 0.05
    attainment: float = 0.9  # --search-rate: highest rate with at least this share of requests in SLO

    def ttft_budget(self, prompt: int) -> float:
        return self.ttft_s + self.ttft_s_per_1k_tokens * prompt / 1000.0


def link_spec(data: dict[str, Any]) -> LinkSpec:
    block = mapping(data.get("link"), "link", {"gbps", "rtt_ms", "fluctuation", "outages"}, required=True)
    gbps = cluster_file.file_link_gbps(data)
    assert gbps is not None
    fl = mapping(block.get("fluctuation"), "link.fluctuation",
                  {"kind", "amplitude", "period_s", "step_s", "sigma", "floor", "ceiling"})
    kind = fl.get("kind", "none")
    if kind not in ("none", "sine", "random_walk"):
        raise SimError(f"link.fluctuation.kind: {kind!r} is unknown; expected none, sine or random_walk")
    path = "link.fluctuation"
    fluct = Fluctuation(
        kind=kind,
        amplitude=number(fl, "amplitude", path, ge=0, lt=1, default=0.0),
        period_s=number(fl, "period_s", path, gt=0, default=600.0),
        step_s=number(fl, "step_s", path, gt=0, default=1.0),
        sigma=number(fl, "sigma", path, ge=0, default=0.05),
        floor=number(fl, "floor", path, gt=0, le=1, default=0.1),
        ceiling=number(fl, "ceiling", path, gt=0, default=1.0),
    )
    if fluct.floor > fluct.ceiling:
        raise SimError(f"link.fluctuation.floor: {fluct.floor:g} is above ceiling {fluct.ceiling:g}")
    outages = []
    raw = block.get("outages") or []
    if not isinstance(raw, list):
        raise SimError("link.outages: expected a list of {start_s, duration_s}")
    for i, item in enumerate(raw):
        o = mapping(item, f"link.outages[{i}]", {"start_s", "duration_s"}, required=True)
        outages.append((number(o, "start_s", f"link.outages[{i}]", ge=0),
                        number(o, "duration_s", f"link.outages[{i}]", gt=0)))
    return LinkSpec(gbps=gbps, rtt_ms=number(block, "rtt_ms", "link", ge=0, default=10.0), fluctuation=fluct,
                    outages=tuple(outages))


def kv_cost(raw: Any) -> KVCost:
    if raw is None:
        raise SimError("model: missing; expected {preset: NAME} (see `crossfill plan --list-models`) "
                       "or {kv_bytes_per_token: N, state_bytes: M}")
    block = mapping(raw, "model", {"preset", "dtype", "state_dtype", "codec_ratio", "name", "kv_bytes_per_token",
                                    "state_bytes"}, required=True)
    ratio = number(block, "codec_ratio", "model", gt=0, default=1.0)
    if "preset" in block:
        if "kv_bytes_per_token" in block:
            raise SimError("model: give either preset or kv_bytes_per_token, not both")
        model = load_model(str(block["preset"]))
        return KVCost.from_model(model, kv_dtype(str(block.get("dtype", "bf16")), "model.dtype"),
                                 kv_dtype(str(block.get("state_dtype", "bf16")), "model.state_dtype"), ratio)
    if "kv_bytes_per_token" not in block:
        raise SimError("model: expected preset or kv_bytes_per_token")
    return KVCost(name=str(block.get("name", "custom model")),
                  growing_bytes_per_token=number(block, "kv_bytes_per_token", "model", gt=0),
                  state_bytes=number(block, "state_bytes", "model", ge=0, default=0.0), codec_ratio=ratio)


def lognormal(body: Any, path: str) -> LogNormalWorkload:
    """A log-normal block validated with its own path (the planner's messages say "workload")."""
    b = mapping(body, path, {"median", "sigma", "min", "max"}, required=True)
    median = number(b, "median", path, gt=0)
    sigma = number(b, "sigma", path)
    if not sigma > 0:
        raise SimError(f"{path}.sigma: {sigma:g} must be > 0 (the spread of ln length; sigma < 0 has no meaning)")
    lo = number(b, "min", path, gt=0, default=1.0)
    hi = number(b, "max", path, gt=0, default=math.inf)
    if not lo < hi:
        raise SimError(f"{path}.min: {lo:g} must be below max {hi:g}")
    return LogNormalWorkload.from_median(median, sigma, lo, hi)


def distribution(raw: Any, path: str) -> Lengths:
    block = mapping(raw, path, {"fixed", "lognormal", "empirical"}, required=True)
    if len(block) != 1:
        raise SimError(f"{path}: expected exactly one of fixed, lognormal, empirical")
    if "fixed" in block:
        return Lengths(fixed=whole(block, "fixed", path, ge=1))
    if "lognormal" in block:
        return Lengths(dist=lognormal(block["lognormal"], f"{path}.lognormal"))
    return Lengths(dist=workload_from_mapping(block, path))


def failures(raw: Any) -> Failures:
    f = mapping(raw, "failures", {"remote_crash_per_hour", "repair_s", "transfer_failure_prob"})
    return Failures(number(f, "remote_crash_per_hour", "failures", ge=0, default=0.0),
                    number(f, "repair_s", "failures", gt=0, default=60.0),
                    number(f, "transfer_failure_prob", "failures", ge=0, lt=1, default=0.0))


def slo(raw: Any, decode: DecodeProfile) -> Slo:
    s = mapping(raw, "slo", {"ttft_ms", "ttft_ms_per_1k_tokens", "tpot_ms", "attainment"})
    return Slo(ttft_s=number(s, "ttft_ms", "slo", gt=0, default=10000.0) / 1000,
               ttft_s_per_1k_tokens=number(s, "ttft_ms_per_1k_tokens", "slo", ge=0, default=0.0) / 1000,
               tpot_s=number(s, "tpot_ms", "slo", gt=0, default=decode.slo_s * 1000) / 1000,
               attainment=number(s, "attainment", "slo", gt=0, le=1, default=0.9))


def service_config(data: dict[str, Any], link: LinkSpec, max_batch: int) -> InferenceServiceConfig:
    """`inference_service` (the live schema, so the same keys mean the same things), with
    `routing` allowed at the top level, and simulation defaults for what the file leaves out."""
    svc = data.get("inference_service")
    svc = {} if svc is None else copy.deepcopy(svc)
    if not isinstance(svc, dict):
        raise SimError("inference_service: expected a mapping (the live config's inference_service block)")
    top_routing = data.get("routing") is not None
    if top_routing:
        if "routing" in svc:
            raise SimError("routing: given both at the top level and under inference_service; keep one")
        svc["routing"] = data["routing"]
    # The live defaults (40 Gbps, 10 ms) describe the seed's link, not the simulated one: by default
    # the link counts as healthy down to a tenth of its nominal bandwidth and up to its round trip.
    network = dict(svc.get("network") or {})
    network.setdefault("min_bandwidth_gbps", link.gbps / 10)
    network.setdefault("max_latency_ms", max(10.0, link.rtt_ms))
    svc["network"] = network
    # A decode instance holds requests waiting for KV as well as the decoding batch.
    decode_pool = dict(svc.get("decode_pool") or {})
    decode_pool.setdefault("max_concurrent_requests", 2 * max_batch)
    svc["decode_pool"] = decode_pool
    try:
        config = InferenceServiceConfig.model_validate(svc)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            err = dict(err)
            loc = tuple(err["loc"])
            if not (top_routing and loc[:1] == ("routing",)):
                loc = ("inference_service", *loc)
            err["loc"] = loc
            lines.append(_format_error(err))
        raise SimError("invalid routing configuration:\n  " + "\n  ".join(lines)) from None
    for dc in config.routing.cost_weights:
        if dc not in (LOCAL_DC, REMOTE_DC):
            raise SimError(f"routing.cost_weights.{dc}: unknown datacenter; the simulated ones are "
                           f"{LOCAL_DC!r} and {REMOTE_DC!r}")
    return config
