"""`crossfill diagnose` as a command, without a cluster: what it says when it cannot read anything."""

from __future__ import annotations

import socket
from pathlib import Path

from typer.testing import CliRunner

from crossfill.cli import app


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_it_needs_exactly_one_of_config_and_url() -> None:
    for args in ([], ["--config", "x.yaml", "--url", "http://127.0.0.1:1"]):
        r = CliRunner().invoke(app, ["diagnose", *args])
        assert r.exit_code == 2 and "give --config FILE" in r.output


def test_a_bad_config_is_exit_2_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("inference_service: {routing: {long_context_threshold_tokens: -1}}\n")
    r = CliRunner().invoke(app, ["diagnose", "--config", str(bad)])
    assert r.exit_code == 2 and "long_context_threshold_tokens" in r.output


def test_an_unreachable_gateway_is_exit_2_not_a_clean_bill_of_health() -> None:
    r = CliRunner().invoke(app, ["diagnose", "--url", f"http://127.0.0.1:{_closed_port()}", "--window", "0"])
    assert r.exit_code == 2 and "nothing could be read" in r.output


def test_a_missing_baseline_file_is_exit_2(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["diagnose", "--url", "http://127.0.0.1:1", "--baseline", str(tmp_path / "no.json")])
    assert r.exit_code == 2 and "no.json" in r.output
