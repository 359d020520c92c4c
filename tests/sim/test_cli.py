"""`crossfill simulate` through the command line: outputs, and bad input refused with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from crossfill.sim.commands import register
from tests.sim.helpers import EXAMPLE, example


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # keeps `simulate` a sub-command, as in the real CLI
        pass

    register(app)
    return app


def run(app: typer.Typer, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["simulate", *args])
    return result.exit_code, result.output


def write(tmp_path: Path, data: dict, name: str = "sim.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_writes_json_and_png(app: typer.Typer, tmp_path: Path) -> None:
    code, out = run(app, "-c", str(EXAMPLE), "-n", "200", "--out", str(tmp_path / "o"), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert json.loads((tmp_path / "o" / "simulate.json").read_text()) == report
    png = (tmp_path / "o" / "simulate.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    names = [s["strategy"] for s in report["strategies"]]
    assert names == ["homogeneous-pd", "naive-remote", "threshold-only", "full-policy"]
    assert "full-policy / homogeneous-pd (goodput_rps)" in report["ratios"]


def test_table_on_the_terminal(app: typer.Typer) -> None:
    code, out = run(app, "-c", str(EXAMPLE), "-n", "150", "--strategies", "homogeneous-pd,full-policy")
    assert code == 0, out
    assert "goodput" in out and "full-policy" in out and "naive-remote" not in out.split("Strategies")[1]


def test_trace_replay(app: typer.Typer, tmp_path: Path) -> None:
    rows = ["time,prompt_tokens,output_tokens,prefix_id,prefix_tokens,session_id,tenant_id,request_type"]
    for i in range(60):
        rows.append(f"{i * 0.5},{4000 + 700 * (i % 40)},200,{'sys' if i % 2 else ''},{2000 if i % 2 else ''},"
                    f"{'s1' if i % 7 == 0 else ''},acme,{'batch' if i % 5 == 0 else 'interactive'}")
    trace = tmp_path / "t.csv"
    trace.write_text("\n".join(rows) + "\n")
    code, out = run(app, "-c", str(EXAMPLE), "--trace", str(trace), "--json", "--strategies", "full-policy")
    assert code == 0, out
    report = json.loads(out)
    assert report["setup"]["requests"] == 60
    assert report["strategies"][0]["completed"] + report["strategies"][0]["error_total"] == 60


def test_search_rate_finds_a_rate(app: typer.Typer, tmp_path: Path) -> None:
    data = example()
    data["failures"] = {}
    code, out = run(app, "-c", write(tmp_path, data), "-n", "150", "--search-rate", "--json",
                    "--strategies", "homogeneous-pd,full-policy")
    assert code == 0, out
    rows = {r["strategy"]: r for r in json.loads(out)["search"]}
    assert rows["full-policy"]["max_rate_rps"] > rows["homogeneous-pd"]["max_rate_rps"] > 0


def _trace_error(app: typer.Typer, tmp_path: Path, body: str) -> str:
    trace = tmp_path / "bad.csv"
    trace.write_text(body)
    code, out = run(app, "-c", str(EXAMPLE), "--trace", str(trace))
    assert code == 2, out
    assert "Traceback" not in out
    return out


@pytest.mark.parametrize("body, words", [
    ("time,prompt_tokens,output_tokens\n0,100,10\n1,-5,10\n", ["row 2", "prompt_tokens", "-5"]),
    ("time,prompt_tokens,output_tokens\n0,100,10\n1,100,\n", ["row 2", "output_tokens is missing"]),
    ("time,prompt_tokens,output_tokens\n0,100,10\n2,100,10\n2,100,10\n", ["row 3", "time 2", "increasing"]),
    ("time,prompt_tokens,output_tokens,request_type\n0,100,10,urgent\n", ["row 1", "request_type", "urgent"]),
    ("time,prompt_tokens,output_tokens,colour\n0,100,10,red\n", ["unknown columns", "colour"]),
])
def test_bad_trace_rows_are_named(app: typer.Typer, tmp_path: Path, body: str, words: list[str]) -> None:
    out = _trace_error(app, tmp_path, body)
    for w in words:
        assert w in out, out


def test_bad_jsonl_row(app: typer.Typer, tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"time": 0, "prompt_tokens": 10, "output_tokens": 5}\n{"time": 1, "prompt_tokens": 10}\n')
    code, out = run(app, "-c", str(EXAMPLE), "--trace", str(trace))
    assert code == 2 and "row 2 (line 2)" in out and "output_tokens" in out


def _edit(path: str, value: object):
    def apply(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return apply


@pytest.mark.parametrize("edit, words", [
    (_edit("workload.lognormal.sigma", -1.0), ["workload.lognormal.sigma", "-1"]),
    (_edit("output.lognormal.sigma", -0.5), ["output.lognormal.sigma"]),
    (_edit("workload.lognormal.min", 200000), ["workload.lognormal.min", "below max"]),
    (_edit("routing.cost_weights", {"remote": -1.0}), ["cost_weights.remote", ">= 0"]),
    (_edit("routing.cost_weights", {"mars": 1.0}), ["cost_weights.mars", "unknown datacenter"]),
    (_edit("routing.tenants", {"acme": {"tier": "gold"}}), ["routing.tenants.acme.tier", "gold"]),
    (_edit("routing.tenants", {"acme": {"request_type": "urgent"}}), ["routing.tenants.acme.request_type"]),
    (_edit("routing.long_context_treshold_tokens", 5), ["routing.long_context_treshold_tokens", "unknown key"]),
    (_edit("arrival.rate", 0), ["arrival.rate", "must be > 0"]),
    (_edit("arrival.process", "bursty"), ["arrival.process", "bursty"]),
    (_edit("link.fluctuation", {"kind": "sine", "amplitude": 1.5}), ["link.fluctuation.amplitude"]),
    (_edit("failures.transfer_failure_prob", 1.0), ["failures.transfer_failure_prob"]),
    (_edit("model", {"preset": "no-such-model"}), ["unknown preset", "no-such-model"]),
    (_edit("pools.local.prefill_instances", 8), ["pools.local.prefill_instances"]),
    (_edit("simulation.strategies", ["fastest"]), ["simulation.strategies[0]", "fastest"]),
    (_edit("decode.slo_ms", 1), ["decode.slo_ms"]),
    (_edit("colour", "red"), ["colour: unknown key"]),
])
def test_bad_file_values_are_named(app: typer.Typer, tmp_path: Path, edit, words: list[str]) -> None:
    data = example()
    edit(data)
    code, out = run(app, "-c", write(tmp_path, data), "-n", "10")
    assert code == 2, out
    assert "Traceback" not in out
    for w in words:
        assert w in out, out


@pytest.mark.parametrize("args, words", [
    (["--rate", "0"], ["--rate", "must be > 0"]),
    (["--rate", "-3"], ["--rate"]),
    (["-n", "0"], ["--requests"]),
    (["--workload", "lognormal:median=100,sigma=-1"], ["sigma"]),
    (["--strategies", "homogeneous-pd,best"], ["best"]),
])
def test_bad_flags(app: typer.Typer, args: list[str], words: list[str]) -> None:
    code, out = run(app, "-c", str(EXAMPLE), *args)
    assert code == 2, out
    for w in words:
        assert w in out, out


def test_missing_file(app: typer.Typer, tmp_path: Path) -> None:
    code, out = run(app, "-c", str(tmp_path / "nope.yaml"))
    assert code == 2 and "does not exist" in out
