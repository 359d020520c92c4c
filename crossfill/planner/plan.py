"""`crossfill plan` without the command line: options in, one result dictionary out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from crossfill.planner import bandwidth, cluster_file, report
from crossfill.planner.calibrate import DEFAULT_LENGTHS, Measurement, calibrated_profile, measure_prefill
from crossfill.planner.dtypes import kv_dtype
from crossfill.planner.errors import PlanError
from crossfill.planner.model_source import load_model, preset_data
from crossfill.planner.optimizer import local_only, optimize
from crossfill.planner.profiles import PrefillProfile, read_yaml
from crossfill.planner.workload import Workload, parse_workload_spec

DEFAULT_CONTEXTS = (4096, 32768, 131072)


@dataclass
class PlanRequest:
    model: str
    context_lens: Sequence[int] = ()
    lengths: str | None = None  # distribution spec, see workload.parse_workload_spec
    dtype: str = "bf16"
    state_dtype: str = "bf16"
    prefill_tps: float | None = None
    profile: str | None = None
    link_gbps: float | None = None
    instances: int | None = None
    plot: str | None = None
    optimize: bool = False
    calibrate: bool = False
    calibrate_lengths: Sequence[int] = DEFAULT_LENGTHS
    save_profile: str | None = None
    measure: Callable[[str, Sequence[int]], list[Measurement]] = field(default=measure_prefill, repr=False)


def _engine_model_name(model: str) -> str:
    """The name crossfill's model registry knows a preset by (``engine_model``), else `model` as given."""
    try:
        return str(preset_data(model).get("engine_model", model))
    except PlanError:
        return model  # a path or a name only the engine knows


def _check_positive(value: float | None, field_name: str) -> None:
    if value is not None and not value > 0:
        raise PlanError(f"{field_name}: {value:g} must be > 0")


def build_plan(req: PlanRequest) -> dict[str, Any]:
    model = load_model(req.model)
    dtype = kv_dtype(req.dtype)
    state_dtype = kv_dtype(req.state_dtype, "--state-dtype")
    for n in req.context_lens:
        if n <= 0:
            raise PlanError(f"--context-len: {n} must be a positive number of tokens")
    _check_positive(req.prefill_tps, "--prefill-tps")
    _check_positive(req.link_gbps, "--link-gbps")
    if req.instances is not None and req.instances < 1:
        raise PlanError(f"--instances: {req.instances} must be >= 1")

    data = read_yaml(req.profile) if req.profile else {}
    result: dict[str, Any] = {}

    # Prefill profile: measured here > --prefill-tps > the profile file.
    override: PrefillProfile | None = None
    if req.calibrate:
        override = calibrated_profile(_engine_model_name(req.model), req.calibrate_lengths, req.measure)
        assert override.kv_bytes is not None
        result["calibration"] = {
            **override.as_dict(),
            "source": override.source,
            "model_kv_bytes": [model.request_bytes(int(n), kv_dtype("fp32"), state_dtype) for n in override.lengths],
        }
        if req.save_profile:
            Path(req.save_profile).write_text(yaml.safe_dump({"prefill": override.as_dict()}, sort_keys=False))
    elif req.prefill_tps is not None:
        override = PrefillProfile.from_tps(req.prefill_tps, source=f"--prefill-tps {req.prefill_tps:g} tok/s")
    prefill = override or cluster_file.default_prefill(data)

    workload: Workload | None = parse_workload_spec(req.lengths) if req.lengths else cluster_file.file_workload(data)
    link_gbps = req.link_gbps if req.link_gbps is not None else cluster_file.file_link_gbps(data)
    instances = req.instances or cluster_file.file_remote_instances(data) or 1

    if req.context_lens:
        contexts = [float(n) for n in req.context_lens]
    elif workload is not None:
        contexts = [workload.quantile(q) for q in (0.5, 0.9, 0.99)]
    else:
        contexts = [float(n) for n in DEFAULT_CONTEXTS]
    result["kv"] = report.kv_summary(model, dtype, state_dtype, contexts)
    if workload is not None:
        result["workload"] = workload.describe()

    if prefill is not None:
        cases = []
        for n in contexts:
            case = bandwidth.link_case(model, dtype, state_dtype, n, prefill, instances, link_gbps)
            alts = bandwidth.alternatives(model, dtype, state_dtype, n, prefill, instances, link_gbps)
            cases.append(report.link_entry(case, alts, link_gbps))
        if workload is not None:
            case = bandwidth.workload_case(model, dtype, state_dtype, workload, prefill, instances, link_gbps)
            alts = bandwidth.workload_alternatives(model, dtype, state_dtype, workload, prefill, instances, link_gbps)
            cases.append(report.link_entry(case, alts, link_gbps))
        warnings = []
        if not prefill.covers(max(contexts)):
            warnings.append(
                f"lengths above {prefill.lengths[-1]:.0f} tokens are extrapolated from the prefill profile's last segment"
            )
        result["link"] = {
            "prefill": prefill.source,
            "instances": instances,
            "link_gbps": link_gbps,
            "cases": cases,
            "warnings": warnings,
        }

    if req.optimize:
        if not req.profile:
            raise PlanError("--optimize: needs --profile with pools, decode (and workload/link unless given as flags)")
        setup = cluster_file.cluster_setup(
            data, model.kv_function(dtype, state_dtype), prefill_override=override, workload=workload, link_gbps=link_gbps
        )
        best, curve = optimize(setup)
        result["optimize"] = report.optimum_summary(setup, best, local_only(setup), curve)

    if req.plot:
        from crossfill.planner.plots import plot_kv_and_phi

        top = int(max(131072, *contexts))
        curve = result.get("optimize", {}).get("curve")
        result["plot"] = str(
            plot_kv_and_phi(req.plot, model, dtype, state_dtype, prefill, link_gbps, instances, top, curve)
        )
    return result
