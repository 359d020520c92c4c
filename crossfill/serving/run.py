"""`crossfill serve ROLE`: one role of the deployment in this process, on the port the config gives it."""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

from crossfill.config import ROLES, ConfigError, CrossfillConfig, load_config


def setup_logging(cfg: CrossfillConfig, name: str) -> None:
    level = cfg.inference_service.observability.log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s", force=True)
    # One line per health probe would drown the request log; keep client libraries at warnings.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def build_app(cfg: CrossfillConfig, role: str, instance: str | None) -> tuple[FastAPI, str, int]:
    if role == "gateway":
        from crossfill.serving.gateway import create_gateway_app

        ep = cfg.topology.gateway
        return create_gateway_app(cfg), ep.host, ep.port
    if role == "scheduler":
        from crossfill.serving.scheduler import create_scheduler_app

        ep = cfg.topology.scheduler
        return create_scheduler_app(cfg), ep.host, ep.port
    candidates = [i for i in cfg.instances() if i.role == role]
    if instance is None:
        if len(candidates) != 1:
            raise ConfigError(f"--instance is required for role {role}: one of {[i.name for i in candidates]}")
        inst = candidates[0]
    else:
        inst = cfg.instance(instance)
        if inst.role != role:
            raise ConfigError(f"instance {instance!r} has role {inst.role}, not {role}")
    if role == "prefill":
        from crossfill.serving.prefill_worker import create_prefill_app

        return create_prefill_app(cfg, inst), inst.host, inst.port
    from crossfill.serving.decode_worker import create_decode_app

    return create_decode_app(cfg, inst), inst.host, inst.port


def serve_role(role: str, config_path: str, instance: str | None) -> int:
    """Run until SIGINT/SIGTERM; returns the exit status."""
    if role not in ROLES:
        print(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
        return 2
    try:
        cfg = load_config(config_path)
        app, host, port = build_app(cfg, role, instance)
    except ConfigError as exc:
        print(str(exc))
        return 2
    setup_logging(cfg, instance or role)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
