"""Liveness and readiness: `/healthz` (the process answers) and `/readyz` (it should get traffic).

Readiness is separate from liveness because a worker that is still loading or warming its model
is alive but must not be routed to (`warmup_before_serving`); the scheduler polls both.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse


class Readiness:
    """A process's readiness flag with the reason it is not ready (shown by /readyz)."""

    def __init__(self, role: str, name: str) -> None:
        self.role = role
        self.name = name
        self.ready = False
        self.reason = "starting"
        self.started = time.time()
        self.draining = False

    def set_ready(self) -> None:
        if not self.draining:  # a drain is final: nothing makes the process ready again
            self.ready, self.reason = True, "ready"

    def set_not_ready(self, reason: str) -> None:
        if not self.draining:
            self.ready, self.reason = False, reason

    def drain(self) -> None:
        self.ready, self.reason, self.draining = False, "draining: finishing in-flight requests, then exiting", True


def add_health_routes(app: FastAPI, readiness: Readiness) -> None:
    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"status": "ok", "role": readiness.role, "instance": readiness.name,
                "uptime_s": round(time.time() - readiness.started, 1)}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        body = {"ready": readiness.ready, "reason": readiness.reason, "role": readiness.role,
                "instance": readiness.name}
        return JSONResponse(body, status_code=200 if readiness.ready else 503)
