"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every service answers bad input and refusals with this body, so a client (or the gateway relaying a
worker's refusal) always learns which field was wrong or why it was refused, never a bare 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("crossfill.serving")
M = TypeVar("M", bound=BaseModel)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error with an HTTP status that should reach the client as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.extra = extra or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        out: dict[str, Any] = {"error": err}
        out.update(self.extra)
        return out

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers(), **(headers or {})})

    @classmethod
    def from_body(cls, status: int, body: Any, retry_after: str | None = None) -> APIError:
        """Rebuild an error a downstream service answered (so the gateway can pass it on)."""
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(502 if status < 400 else status, f"upstream answered HTTP {status}", code="upstream_error")
        ra = int(retry_after) if retry_after and retry_after.isdigit() else None
        extra = {k: v for k, v in body.items() if k != "error"}
        return cls(status, str(err.get("message")), param=err.get("param"), code=err.get("code"),
                   retry_after=ra, extra=extra)


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts)


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first problem of a pydantic validation, as a 400 naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "missing":
        msg = f"'{param}' is a required field"
    elif kind == "extra_forbidden":
        msg = f"'{param}' is not a known field"
    else:
        msg = f"'{param}': {first.get('msg', 'invalid value')}"
        if "input" in first and not isinstance(first["input"], dict | list):
            msg += f" (got {first['input']!r})"
    return APIError(400, msg, param=param or None, code="invalid_value" if kind != "missing" else "missing_field")


async def parse_body(request: Request, model: type[M]) -> M:
    """Read and validate a JSON body; malformed JSON or bad fields become 400s naming the problem."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


class JSONWhenCancelled:
    """ASGI middleware: a request cancelled before its response started still gets a JSON error.

    uvicorn cancels the requests left when a graceful shutdown runs out of time and answers them
    with a plain-text "500 Internal Server Error". Cancellation arrives once, so this can still
    send a 503 in the error schema (the caller retries it elsewhere) before letting it go on.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not started:
                err = APIError(503, "the service is shutting down; retry the request", code="shutting_down",
                               retry_after=1)
                body = json.dumps(err.body()).encode()
                headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                           (b"content-length", str(len(body)).encode())]
                try:
                    await send({"type": "http.response.start", "status": 503, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                except Exception:  # noqa: BLE001 - the connection is gone too: nobody to answer
                    pass
            raise


def install_error_handlers(app: FastAPI) -> None:
    """Map every failure to an OpenAI error body; unexpected exceptions become a logged 500 body."""
    app.add_middleware(JSONWhenCancelled)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()
