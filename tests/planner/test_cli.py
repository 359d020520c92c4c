"""`crossfill plan` end to end through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from crossfill.planner.commands import register
from crossfill.planner.plan import PlanRequest, build_plan

EXAMPLE = Path(__file__).parents[2] / "crossfill" / "planner" / "examples" / "cluster-example.yaml"


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # keeps `plan` a sub-command, as in the real CLI
        pass

    register(app)
    return app


def run(app: typer.Typer, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["plan", *args])
    return result.exit_code, result.output


def test_dense_model_needs_compression_hybrid_fits(app: typer.Typer) -> None:
    args = ["-c", "32768", "--prefill-tps", "20000", "--link-gbps", "100", "-n", "4", "--json"]
    code, out = run(app, "-m", "llama-3.1-70b", *args)
    assert code == 0, out
    case = json.loads(out)["link"]["cases"][0]
    kv = 32768 * 80 * 2 * 8 * 128 * 2
    assert case["kv_bytes"] == kv
    assert case["phi_gbps"] == pytest.approx(kv * 8 / (32768 / 20000) / 1e9)
    assert case["pool_egress_gbps"] == pytest.approx(4 * case["phi_gbps"])
    assert case["fits"] is False and "fits with Llama-3.1-70B as int4" in case["verdict"]
    assert case["link_max_rps"] == pytest.approx(100e9 / 8 / kv)

    code, out = run(app, "-m", "qwen3-next-80b-a3b", *args)
    case = json.loads(out)["link"]["cases"][0]
    assert case["fits"] is True
    dense = next(a for a in case["alternatives"] if "all global attention" in a["label"])
    assert dense["kv_bytes"] > 3 * case["kv_bytes"]


def test_text_report_and_distribution(app: typer.Typer) -> None:
    code, out = run(app, "-m", "gemma-3-270m", "--lengths", "lognormal:median=2000,sigma=1,min=16,max=32768",
                    "--prefill-tps", "150")
    assert code == 0, out
    assert "sliding layers keep window - 1 (crossfill engine) tokens" in out
    assert "(workload mean)" in out
    assert out.count(" tokens: ") >= 3  # p50, p90, p99 rows


def test_optimize_with_example_profile(app: typer.Typer) -> None:
    code, out = run(app, "-m", "kimi-linear-48b-a3b", "--profile", str(EXAMPLE), "--optimize", "--json")
    assert code == 0, out
    opt = json.loads(out)["optimize"]
    best, base = opt["best"], opt["local_only"]
    assert best["throughput_rps"] >= base["throughput_rps"]
    assert best["local_prefill_instances"] + best["decode_instances"] == 12
    assert 0 <= best["offload_share"] <= 1
    assert max(c["throughput_rps"] for c in opt["curve"]) == pytest.approx(best["throughput_rps"])
    low, high = opt["near_optimal_thresholds"]
    assert low <= best["threshold"] <= high


def test_plot_is_written(app: typer.Typer, tmp_path: Path) -> None:
    target = tmp_path / "kv.png"
    code, out = run(app, "-m", "mimo-v2-flash", "--profile", str(EXAMPLE), "--optimize", "--plot", str(target))
    assert code == 0, out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _profile(tmp_path: Path, **changes: object) -> str:
    data = yaml.safe_load(EXAMPLE.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--model: required"),
        (["-m", "gpt-17"], "unknown preset 'gpt-17'"),
        (["-m", "llama-3.1-8b", "--dtype", "fp6"], "--dtype: unknown KV dtype"),
        (["-m", "llama-3.1-8b", "-c", "0"], "--context-len: 0 must be a positive"),
        (["-m", "llama-3.1-8b", "--optimize"], "--optimize: needs --profile"),
        (["-m", "llama-3.1-8b", "--profile", "/nonexistent.yaml"], "--profile: file /nonexistent.yaml does not exist"),
    ],
)
def test_bad_flags_exit_2_with_the_field(app: typer.Typer, args: list[str], message: str) -> None:
    code, out = run(app, *args)
    assert code == 2
    assert message in out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prefill__lengths": [1024, 4096, 4096, 65536, 131072]}, "prefill.lengths[2]: 4096 is not greater"),
        ({"prefill__seconds": [0.08, -0.3, 1.3, 6.0, 14.5]}, "prefill.seconds[1]: -0.3 is negative"),
        ({"decode__slo_ms": 5}, "decode.slo_ms: 5 ms is below the fastest step"),
        ({"pools__local__instances": 0}, "pools.local.instances: 0 must be >= 1"),
        ({"pools__remote__instances": "four"}, "pools.remote.instances: 'four'; expected a whole number"),
        ({"link__gbps": -10}, "link.gbps: -10 must be > 0 Gbps"),
        ({"workload": {"lognormal": {"median": 5000, "sigma": -1}}}, "workload.sigma: -1.0 must be > 0"),
        ({"decode__batch": [1, 16, 8, 128, 256]}, "decode.batch[2]: 8 is not greater"),
    ],
)
def test_bad_profiles_exit_2_with_the_field(app: typer.Typer, tmp_path: Path, changes: dict, message: str) -> None:
    code, out = run(app, "-m", "qwen3-next-80b-a3b", "--profile", _profile(tmp_path, **changes), "--optimize")
    assert code == 2
    assert message in out


def test_calibration_feeds_the_plan(tmp_path: Path) -> None:
    def fake_measure(model: str, lengths: list[int]) -> list[tuple[int, float, int]]:
        return [(n, n / 200.0, n * 46080) for n in lengths]  # 200 tok/s, SmolLM2 fp32 KV

    saved = tmp_path / "calibrated.yaml"
    result = build_plan(PlanRequest(model="smollm2-135m", context_lens=[1000], calibrate=True,
                                    calibrate_lengths=[128, 512], link_gbps=1.0, measure=fake_measure,
                                    save_profile=str(saved)))
    assert result["calibration"]["model_kv_bytes"] == result["calibration"]["kv_bytes"]
    case = result["link"]["cases"][0]
    assert case["prefill_seconds"] == pytest.approx(5.0)
    assert yaml.safe_load(saved.read_text())["prefill"]["lengths"] == [128, 512]


def test_calibrate_uses_the_engine_registry_name() -> None:
    seen: list[str] = []

    def fake_measure(model: str, lengths: list[int]) -> list[tuple[int, float, int]]:
        seen.append(model)
        return [(n, n / 100.0, 0) for n in lengths]

    build_plan(PlanRequest(model="gemma-3-270m", calibrate=True, calibrate_lengths=[64, 128], measure=fake_measure))
    assert seen == ["gemma3-270m"]


@pytest.mark.realmodel
def test_real_calibration_matches_accounting() -> None:
    cache = pytest.importorskip("crossfill.models.cache")
    if not cache.is_cached("smollm2-135m"):
        pytest.skip("smollm2-135m is not in the model cache (crossfill pull smollm2-135m)")
    from crossfill.planner.calibrate import measure_prefill
    from crossfill.planner.dtypes import KV_DTYPES
    from crossfill.planner.model_source import load_model

    rows = measure_prefill("smollm2-135m", [32, 64])
    model = load_model("smollm2-135m")
    for n, seconds, kv_bytes in rows:
        assert seconds > 0
        assert kv_bytes == model.request_bytes(n, KV_DTYPES["fp32"])
