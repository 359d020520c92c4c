"""`crossfill plan`: KV size, link bandwidth need and the best offload threshold, offline."""

from __future__ import annotations

import json
import math
from typing import Annotated

import typer

from crossfill.planner.calibrate import DEFAULT_LENGTHS
from crossfill.planner.errors import PlanError
from crossfill.planner.model_source import preset_data, preset_names
from crossfill.planner.plan import PlanRequest, build_plan
from crossfill.planner.report import render_text


def _json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def json_safe(value: object) -> object:
    """inf/nan become null so --json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _int_list(text: str, field: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise PlanError(f"{field}: {text!r} is not a comma-separated list of token counts") from exc


def register(app: typer.Typer) -> None:
    @app.command()
    def plan(
        model: Annotated[str | None, typer.Option("--model", "-m", help="Preset name, HF id or config.json path.")] = None,
        context_len: Annotated[
            list[int] | None, typer.Option("--context-len", "-c", help="Prompt length in tokens (repeatable).")
        ] = None,
        lengths: Annotated[
            str | None,
            typer.Option(help="Length distribution: 'lognormal:median=8192,sigma=1,min=128,max=131072' or 'empirical:FILE'."),
        ] = None,
        dtype: Annotated[str, typer.Option(help="KV dtype: fp32, bf16, fp16, fp8, int8, int4.")] = "bf16",
        state_dtype: Annotated[str, typer.Option(help="dtype of linear-attention states.")] = "bf16",
        prefill_tps: Annotated[float | None, typer.Option(help="Prefill throughput of one instance, tokens/s.")] = None,
        profile: Annotated[
            str | None, typer.Option(help="YAML: prefill latency profile, pools, decode profile, link, workload.")
        ] = None,
        link_gbps: Annotated[float | None, typer.Option(help="Inter-DC link bandwidth, Gbps.")] = None,
        instances: Annotated[int | None, typer.Option("--instances", "-n", help="Prefill instances behind the link.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
        plot: Annotated[str | None, typer.Option(help="Write KV-vs-length and Phi-vs-length plots to this PNG.")] = None,
        do_optimize: Annotated[
            bool, typer.Option("--optimize", help="Search the offload threshold and local prefill/decode split.")
        ] = False,
        calibrate: Annotated[
            bool, typer.Option("--calibrate", help="Measure prefill time and KV bytes with crossfill's engine here.")
        ] = False,
        calibrate_lengths: Annotated[
            str, typer.Option(help="Comma-separated prompt lengths for --calibrate.")
        ] = ",".join(str(n) for n in DEFAULT_LENGTHS),
        save_profile: Annotated[str | None, typer.Option(help="Write the calibrated prefill profile as YAML.")] = None,
        list_models: Annotated[bool, typer.Option("--list-models", help="List the model presets and exit.")] = False,
    ) -> None:
        """KV size, bandwidth need and the best offload threshold for a model, a workload and a link."""
        try:
            if list_models:
                for key in preset_names():
                    data = preset_data(key)
                    typer.echo(f"{key:22s} {data['name']:22s} {data['sources'][0]}")
                return
            if not model:
                raise PlanError("--model: required; a preset (see --list-models), an HF id alias or a config.json path")
            result = build_plan(
                PlanRequest(
                    model=model,
                    context_lens=context_len or [],
                    lengths=lengths,
                    dtype=dtype,
                    state_dtype=state_dtype,
                    prefill_tps=prefill_tps,
                    profile=profile,
                    link_gbps=link_gbps,
                    instances=instances,
                    plot=plot,
                    optimize=do_optimize,
                    calibrate=calibrate,
                    calibrate_lengths=_int_list(calibrate_lengths, "--calibrate-lengths"),
                    save_profile=save_profile,
                )
            )
        except PlanError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        if as_json:
            typer.echo(json.dumps(json_safe(result), indent=2, default=_json_default))
        else:
            typer.echo(render_text(result))
