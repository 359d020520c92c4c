"""`crossfill serve ROLE`: one role of the deployment in this process, on the port the config gives it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi import FastAPI

from crossfill.config import ROLES, ConfigError, CrossfillConfig, Instance, load_config
from crossfill.security.auth import apply_no_auth, log_auth_mode
from crossfill.security.tls_http import server_ssl_kwargs

log = logging.getLogger("crossfill.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGTERM/SIGINT.

    The app's `drain()` stops admitting (the process turns not-ready, so the scheduler stops
    routing to it and late arrivals get a JSON 503 that callers retry elsewhere) and returns when
    the requests in flight have finished; only then does uvicorn close its sockets. A second
    signal, or `drain_timeout_s` passing, exits at once (what is still running then gets its
    explicit error from the caller's side: a broken stream is retried or reported).
    """

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]] | None,
                 drain_timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is None or self._loop is None or self._draining:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
        # Signal handlers run between bytecodes of the loop's own thread: hand over, do not run here.
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))  # type: ignore[union-attr]

    async def _drain_then_exit(self) -> None:
        assert self._drain is not None
        try:
            await asyncio.wait_for(self._drain(), self._drain_timeout_s)
        except TimeoutError:
            log.warning("drain did not finish within serving.drain_timeout_s (%gs); exiting anyway",
                        self._drain_timeout_s)
        except Exception:  # noqa: BLE001 - exiting is still right; say why the drain broke
            log.exception("drain failed; exiting")
        self.should_exit = True


def setup_logging(cfg: CrossfillConfig, name: str) -> None:
    level = cfg.inference_service.observability.log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s", force=True)
    # One line per health probe would drown the request log; keep client libraries at warnings.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


@dataclass(frozen=True)
class ExtraInstance:
    """Scale out: where an instance that the config file does not list runs (`serve --datacenter --port`)."""

    datacenter: str | None
    port: int | None
    kv_port: int | None = None
    host: str | None = None

    def instance(self, cfg: CrossfillConfig, role: str, name: str | None) -> Instance:
        if role not in ("prefill", "decode"):
            raise ConfigError(f"--datacenter/--port start a prefill or decode instance, not a {role}")
        if name is None or self.datacenter is None or self.port is None:
            raise ConfigError("an instance the config does not list needs --instance NAME, --datacenter and --port")
        if any(i.name == name for i in cfg.instances()):
            raise ConfigError(f"instance {name!r} is in the config already: start it with --instance only")
        dc = cfg.topology.datacenters.get(self.datacenter)
        if dc is None:
            raise ConfigError(f"--datacenter {self.datacenter!r}: not in topology.datacenters "
                              f"({sorted(cfg.topology.datacenters)})")
        if role == "decode" and self.kv_port is None:
            raise ConfigError("a decode instance needs --kv-port (where prefill sends its KV)")
        return Instance(name, role, self.datacenter, self.host or dc.host, self.port, self.kv_port,  # type: ignore[arg-type]
                        cfg.http_scheme())


def build_app(cfg: CrossfillConfig, role: str, instance: str | None,
              extra: ExtraInstance | None = None) -> tuple[FastAPI, str, int, str]:
    """(app, host, port, service name: "gateway", "scheduler" or the instance's name)."""
    if role == "gateway":
        from crossfill.serving.gateway import create_gateway_app

        ep = cfg.topology.gateway
        return create_gateway_app(cfg), ep.host, ep.port, "gateway"
    if role == "scheduler":
        from crossfill.serving.scheduler import create_scheduler_app

        ep = cfg.topology.scheduler
        return create_scheduler_app(cfg), ep.host, ep.port, "scheduler"
    candidates = [i for i in cfg.instances() if i.role == role]
    if extra is not None:
        inst = extra.instance(cfg, role, instance)
    elif instance is None:
        if len(candidates) != 1:
            raise ConfigError(f"--instance is required for role {role}: one of {[i.name for i in candidates]}")
        inst = candidates[0]
    else:
        inst = cfg.instance(instance)
        if inst.role != role:
            raise ConfigError(f"instance {instance!r} has role {inst.role}, not {role}")
    if role == "prefill":
        from crossfill.serving.prefill_worker import create_prefill_app

        return create_prefill_app(cfg, inst), inst.host, inst.port, inst.name
    from crossfill.serving.decode_worker import create_decode_app

    return create_decode_app(cfg, inst), inst.host, inst.port, inst.name


def serve_role(role: str, config_path: str, instance: str | None, extra: ExtraInstance | None = None) -> int:
    """Run until SIGINT/SIGTERM; returns the exit status."""
    if role not in ROLES:
        print(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
        return 2
    try:
        cfg = apply_no_auth(load_config(config_path))  # `--no-auth` (CROSSFILL_NO_AUTH=1) turns API keys off
        app, host, port, service = build_app(cfg, role, instance, extra)
        # Mutual TLS for every listener between services; the gateway's public one takes API keys.
        ssl_kwargs = {} if role == "gateway" else server_ssl_kwargs(cfg, service)
    except ConfigError as exc:
        print(str(exc))
        return 2
    setup_logging(cfg, instance or role)
    if role in ("gateway", "scheduler"):
        log_auth_mode(cfg, role)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            **ssl_kwargs)
    server = DrainingServer(config, getattr(app.state, "drain", None), cfg.serving.drain_timeout_s)
    server.run()
    return 0
