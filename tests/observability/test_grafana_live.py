"""The Grafana dashboard against a live cluster: every metric a panel queries is on some /metrics.

One cluster under mutual TLS (as deployed: `crossfill up` writes the certificates), some local
and remote traffic, then this test scrapes the way Prometheus would with the scrape config
`crossfill prometheus-config` makes for that cluster (deploy/prometheus.yml is the same for
examples/two-dc.yaml): each job's scheme, its targets, and its tls_config files resolved against
the config file's folder. Every metric name in every panel expression of
deploy/grafana/crossfill-dashboard.json must be offered by a scraped service.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from serving.serving_cluster import Cluster, launch_cluster
from serving.serving_helpers import LONG, SHORT, generate

from crossfill.observability.prometheus_config import render

from .promql_names import exposed_names, metric_names

pytestmark = pytest.mark.timeout(600)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "crossfill-dashboard.json"


def _tls_on(doc: dict) -> None:
    doc["security"]["tls"] = {"enabled": True}


@pytest.fixture(scope="module")
def tls_cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("grafana"), edit=_tls_on) as c:
        yield c


def _scrape_as_prometheus(config_file: Path) -> dict[str, str]:
    """GET every target of the scrape config as Prometheus does; service label -> /metrics text."""
    doc = yaml.safe_load(config_file.read_text())
    pages = {}
    for job in doc["scrape_configs"]:
        scheme = job.get("scheme", "http")
        kwargs: dict = {}
        if "tls_config" in job:
            files = {k: config_file.parent / v for k, v in job["tls_config"].items()}
            ctx = ssl.create_default_context(cafile=str(files["ca_file"]))  # checks the target's host name too
            ctx.load_cert_chain(str(files["cert_file"]), str(files["key_file"]))
            kwargs["verify"] = ctx
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                r = httpx.get(f"{scheme}://{target}{job['metrics_path']}", timeout=10, trust_env=False, **kwargs)
                assert r.status_code == 200, (job["job_name"], target, r.status_code)
                pages[sc["labels"]["service"]] = r.text
    return pages


def test_every_dashboard_query_names_a_metric_a_live_service_exposes(tls_cluster: Cluster, tmp_path: Path) -> None:
    c = tls_cluster
    assert c.cfg.security.tls.enabled and c.worker_url("far-prefill-0").startswith("https://")
    for prompt, policy in ((SHORT, "local_only"), (LONG, "remote_required"), (LONG + " again", "auto")):
        r = generate(c.url, prompt, policy, max_tokens=4)
        assert r.status_code == 200, r.text
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(render(c.cfg, str(c.path), tmp_path))

    pages = _scrape_as_prometheus(config_file)
    assert set(pages) == {i.name for i in c.cfg.instances()}  # every service, the gateway included
    live = set().union(*(exposed_names(text) for text in pages.values()))
    assert 'route="remote"' in pages["gateway"]  # the traffic is there, not only declarations

    dash = json.loads(DASHBOARD.read_text())
    missing = {}
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            unknown = metric_names(target["expr"]) - live
            if unknown:
                missing[f"{panel['title']}: {target['expr']}"] = sorted(unknown)
    assert not missing, json.dumps(missing, indent=1)
