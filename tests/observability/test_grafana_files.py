"""deploy/: the Prometheus scrape config matches the topology, the Grafana dashboard is well formed.

No cluster here: the scrape targets are checked against what `crossfill config check` prints for
examples/two-dc.yaml (the topology `make serve` / `crossfill up` runs), and the file against what
`crossfill prometheus-config` makes from it. test_grafana_live.py checks every panel's metric
names against a live cluster's /metrics.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crossfill.config import load_config
from crossfill.observability.prometheus_config import render

from .promql_names import metric_names

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "two-dc.yaml"
PROMETHEUS_YML = REPO / "deploy" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "crossfill-dashboard.json"


def _config_check_services() -> dict[str, tuple[str, str]]:
    """name -> (role, host:port) from `crossfill config check examples/two-dc.yaml`."""
    out = subprocess.run([sys.executable, "-m", "crossfill.cli", "config", "check", str(EXAMPLE)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"^\s+(\S+)\s+(gateway|scheduler|prefill|decode)\s+\S+\s+(\S+:\d+)", out, re.MULTILINE)
    assert rows, out
    return {name: (role, addr) for name, role, addr in rows}


def _scrape_targets() -> dict[str, tuple[str, str, dict]]:
    """service label -> (role label, target, job) from deploy/prometheus.yml."""
    doc = yaml.safe_load(PROMETHEUS_YML.read_text())
    out = {}
    for job in doc["scrape_configs"]:
        for sc in job["static_configs"]:
            (target,) = sc["targets"]
            out[sc["labels"]["service"]] = (sc["labels"]["role"], target, job)
    return out


def test_every_service_of_the_example_topology_is_scraped_at_its_port() -> None:
    services = _config_check_services()
    targets = _scrape_targets()
    assert {n: (role, addr) for n, (role, addr, _) in targets.items()} == services


def test_internal_services_are_scraped_over_mutual_tls_with_the_operator_certificate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Relative file names in a Prometheus config are resolved against the config file's folder.
    monkeypatch.chdir(REPO)
    sec = Path(load_config(EXAMPLE).security.dir)
    for name, (role, _, job) in _scrape_targets().items():
        if role == "gateway":  # the public port: plain http (API keys, not certificates)
            assert job.get("scheme", "http") == "http" and "tls_config" not in job
            continue
        assert job["scheme"] == "https", name
        files = {k: (PROMETHEUS_YML.parent / v).resolve() for k, v in job["tls_config"].items()}
        assert files == {"ca_file": (sec / "ca.pem").resolve(), "cert_file": (sec / "operator.pem").resolve(),
                         "key_file": (sec / "operator.key").resolve()}


def test_the_scrape_config_is_what_prometheus_config_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert PROMETHEUS_YML.read_text() == render(load_config(EXAMPLE), "examples/two-dc.yaml", Path("deploy"))


def test_dashboard_panels_each_query_a_metric_through_the_datasource_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert metric_names(t["expr"]), (p["title"], t["expr"])


def test_promql_metric_names_skip_functions_labels_ranges_and_variables() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, route) (rate(crossfill_ttft_seconds_bucket{job="x",route!="a b"}'
            '[$__rate_interval]))) / on (route) group_left max without (le) (up offset 5m) > bool 1e3')
    assert metric_names(expr) == {"crossfill_ttft_seconds_bucket", "up"}
