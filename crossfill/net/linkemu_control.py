"""HTTP control endpoint of the link emulator (FastAPI served by uvicorn in the emulator's loop).

    GET  /link    settings, armed faults and byte counters
    POST /link    change any of {"bandwidth", "latency", "jitter", "loss"} (same units as the CLI;
                  numbers: bandwidth in bits/s, latency/jitter in ms, loss as a fraction;
                  "bandwidth": null removes the limit)
    POST /faults  arm {"cut_after_bytes": N}, {"corrupt_bytes": K}, {"stall_ms": T},
                  {"partition_ms": T} (the link is down: nothing crosses, new connections are held)
                  or {"reorder_ms": R} (extra per-chunk delay up to R ms until disarmed; 0 turns it
                  off), optionally with "direction": "up" (client -> upstream, the default) or
                  "down" for cut and corrupt
    DELETE /faults  disarm everything (ends a stall or partition at once)
    POST /capture   record every byte that crosses from now on, {"max_bytes": N} optional
                    (crossfill.net.capture; a fresh capture each time)
    GET  /capture   what was recorded: per connection and direction, base64
    DELETE /capture stop recording and drop it

A bad body is answered 400 with {"error": ..., "field": <the offending field>}.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, model_validator

from crossfill.net.capture import DEFAULT_MAX_BYTES
from crossfill.net.units import UnitError, parse_bandwidth, parse_duration, parse_loss

if TYPE_CHECKING:
    from crossfill.net.linkemu import LinkEmulator

Value = StrictStr | StrictInt | StrictFloat


class LinkUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bandwidth: Value | None = None
    latency: Value | None = None
    jitter: Value | None = None
    loss: Value | None = None


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cut_after_bytes: StrictInt | None = Field(default=None, ge=0)
    corrupt_bytes: StrictInt | None = Field(default=None, ge=0)
    stall_ms: StrictInt | StrictFloat | None = Field(default=None, ge=0)
    partition_ms: StrictInt | StrictFloat | None = Field(default=None, ge=0)
    reorder_ms: StrictInt | StrictFloat | None = Field(default=None, ge=0)
    direction: Literal["up", "down"] = "up"

    @model_validator(mode="after")
    def _one_fault(self) -> FaultRequest:
        if all(getattr(self, name) is None for name in _FAULTS):
            raise ValueError(f"arm at least one of {', '.join(_FAULTS)}")
        return self


class CaptureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_bytes: StrictInt = Field(default=DEFAULT_MAX_BYTES, ge=1, le=1024 * 1024 * 1024)


_FAULTS = ("cut_after_bytes", "corrupt_bytes", "stall_ms", "partition_ms", "reorder_ms")


_PARSERS = {
    "bandwidth": parse_bandwidth,
    "latency": parse_duration,
    "jitter": parse_duration,
    "loss": parse_loss,
}


def _bad(field: str | None, error: str) -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": error, "field": field})


def build_app(emu: LinkEmulator) -> FastAPI:
    app = FastAPI(title="crossfill link emulator", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = loc[0] if loc else None
        if err.get("type") == "json_invalid":
            return _bad(None, "the body is not valid JSON")
        return _bad(field, f"{field or 'body'}: {err.get('msg')}")

    @app.get("/link")
    async def get_link() -> dict[str, Any]:
        return emu.status()

    @app.post("/link")
    async def post_link(body: LinkUpdate) -> Any:
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            return _bad(None, "give at least one of bandwidth, latency, jitter, loss")
        for name, value in changes.items():  # validate every field before changing any
            if value is None and name != "bandwidth":
                return _bad(name, f"{name} cannot be null")
            try:
                if value is not None:
                    _PARSERS[name](value)
            except UnitError as exc:
                return _bad(name, str(exc))
        emu.update(**changes)
        return emu.status()

    @app.post("/faults")
    async def post_faults(body: FaultRequest) -> dict[str, Any]:
        emu.arm(
            cut_after_bytes=body.cut_after_bytes,
            corrupt_bytes=body.corrupt_bytes,
            stall_ms=body.stall_ms,
            direction=body.direction,
            partition_ms=body.partition_ms,
            reorder_ms=body.reorder_ms,
        )
        return emu.status()

    @app.delete("/faults")
    async def delete_faults() -> dict[str, Any]:
        emu.disarm()
        return emu.status()

    @app.post("/capture")
    async def post_capture(body: CaptureRequest | None = None) -> dict[str, Any]:
        capture = emu.start_capture((body or CaptureRequest()).max_bytes)
        return {"capturing": True, "max_bytes": capture.max_bytes}

    @app.get("/capture")
    async def get_capture() -> Any:
        if emu.capture is None:
            return JSONResponse(status_code=404, content={"error": "no capture armed (POST /capture)",
                                                          "field": None})
        return emu.capture.as_json()

    @app.delete("/capture")
    async def delete_capture() -> dict[str, Any]:
        capture = emu.stop_capture()
        return {"capturing": False, "captured_bytes": capture.captured_bytes if capture else 0}

    return app


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the emulator's owner (the CLI, a test) handles signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # the name in older uvicorn releases
        pass


class ControlServer:
    """Runs the control app on (host, port) inside the running event loop; `port` is the bound one."""

    def __init__(self, emu: LinkEmulator, host: str, port: int) -> None:
        self._sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(build_app(emu), log_level="warning", access_log=False, lifespan="off")
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                await self._task  # surfaces the startup error
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._sock.close()
