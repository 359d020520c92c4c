"""A Prometheus scrape config for a deployment: every service's `/metrics`, from the config file.

One scrape job per role (gateway, scheduler, prefill, decode), one target per instance, labelled
with the instance's `service` name, `role` and `datacenter`, so dashboards can group by them
whatever addresses the instances have. Every target is scraped directly at its own address, never
through a WAN link emulator: monitoring traffic must not load the link it measures.

Under mutual TLS (`security.tls.enabled`, the default) every internal service (scheduler and
workers) accepts only clients with a certificate from the deployment's CA, so their jobs scrape
over https with the operator certificate (`operator.pem`/`.key` in `security.dir`). The gateway's
public port is plain http. Prometheus resolves relative file names against the directory of its
config file, so the paths are written relative to where the scrape config will live.

`deploy/prometheus.yml` is this module's output for `examples/two-dc.yaml`
(`crossfill prometheus-config --config examples/two-dc.yaml --out deploy/prometheus.yml`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from crossfill.config import CrossfillConfig
from crossfill.security import paths

SCRAPE_INTERVAL = "5s"  # the dashboard's rates use $__rate_interval, which Grafana keeps >= 4 intervals
_ROLES = ("gateway", "scheduler", "prefill", "decode")


def _tls_files(cfg: CrossfillConfig, relative_to: Path) -> dict[str, str]:
    cert, key = paths.cert_paths(cfg, paths.OPERATOR)

    def rel(p: Path) -> str:
        return p.as_posix() if p.is_absolute() else Path(os.path.relpath(p, relative_to)).as_posix()

    return {"ca_file": rel(paths.ca_path(cfg)), "cert_file": rel(cert), "key_file": rel(key)}


def scrape_config(cfg: CrossfillConfig, relative_to: Path = Path(".")) -> dict[str, Any]:
    """The scrape config as a dict; file paths relative to `relative_to` (the config file's directory)."""
    jobs: list[dict[str, Any]] = []
    by_role = {role: [i for i in cfg.instances() if i.role == role] for role in _ROLES}
    for role, instances in by_role.items():
        if not instances:
            continue
        job: dict[str, Any] = {"job_name": f"crossfill-{role}", "metrics_path": "/metrics"}
        if instances[0].scheme == "https":
            job["scheme"] = "https"
            job["tls_config"] = _tls_files(cfg, relative_to)
        job["static_configs"] = [
            {"targets": [f"{i.host}:{i.port}"], "labels": {"service": i.name, "role": i.role, "datacenter": i.datacenter}}
            for i in instances]
        jobs.append(job)
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": jobs}


def render(cfg: CrossfillConfig, config_source: str, relative_to: Path = Path(".")) -> str:
    """The scrape config as YAML, with a header naming the config it was made from."""
    head = (f"# Prometheus scrape config for the crossfill deployment in {config_source}\n"
            "# Made by `crossfill prometheus-config`; docs/OBSERVABILITY.md says how to run it.\n"
            "# Internal services run mutual TLS: the operator certificate is presented to them.\n")
    return head + yaml.safe_dump(scrape_config(cfg, relative_to), sort_keys=False)
