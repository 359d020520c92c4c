"""The gateway's OpenAPI document: every request body, every response it can give, the API-key scheme.

The gateway's handlers read their bodies by hand (crossfill.serving.errors.parse_body, for errors
that name the field), so FastAPI sees no body parameter and would publish paths without bodies.
This module fills the document from the same pydantic models the handlers validate with
(openai_schema) and the response contracts (openai_responses): a route decorator takes
`openapi_extra=request_body(Model, examples)` and `responses=responses(...)`, and `install` adds the
models' schemas as components, the bearer-key security scheme, and the served model name as the only
accepted `model`. Routes every service shares (health, metrics) are documented here too, by path. A fuzzer reading /openapi.json (tests/security/test_openapi_fuzz.py) thereby
generates requests the gateway takes seriously, and can check every answer against the document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from crossfill.serving.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ErrorBody,
    GenerateChunk,
    GenerateResponse,
    Health,
    ModelList,
    Readiness,
)
from crossfill.serving.openai_schema import ChatCompletionRequest, CompletionRequest, GenerateRequest

SECURITY_SCHEME = "ApiKey"
_REF = "#/components/schemas/{model}"
_REQUESTS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, GenerateRequest)
_RESPONSES: tuple[type[BaseModel], ...] = (ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk,
                                           GenerateResponse, GenerateChunk, ModelList, ErrorBody, Health, Readiness)

# Every refusal the gateway (with its auth and limits in front) can answer, and why.
ERRORS: dict[int, str] = {
    400: "The body is not valid JSON or a field is invalid (`error.param` names it), or the prompt does not fit "
         "the context.",
    401: "No API key, or an unknown or revoked one (security.auth).",
    403: "The key may not do this (a tenant other than its own, or an admin call without admin rights).",
    404: "The model is not served here (GET /v1/models).",
    408: "The request body did not arrive in time (security.limits.client_body_timeout_s).",
    409: "A request with this request_id is in flight (/v1/generate: ids must be unique).",
    413: "The request body is larger than security.limits.max_body_bytes.",
    429: "A limit of the tenant or a full queue; retry after `Retry-After` seconds.",
    502: "A worker failed before the answer started.",
    503: "The cluster is starting, draining or has no capacity; retry after `Retry-After` seconds.",
    504: "The decode instance serving the request stopped answering.",
}
# What every generation endpoint can answer besides 200 (/v1/generate adds 409: its ids are the client's).
POST_ERRORS = (400, 401, 403, 404, 408, 413, 429, 502, 503, 504)
_DESCRIPTION = ("OpenAI-compatible chat and completions, and the native /v1/generate, served by a crossfill "
                "cluster. Every answer reports its route: the `crossfill` object in the body (the last event of "
                "a stream) and the `x-crossfill-route` header. Errors are `{\"error\": {message, type, param, "
                "code}}`.")
# The headers of every successful generation (the route report, and the id the logs carry).
_ROUTE_HEADERS = {
    "x-crossfill-route": {"description": "The route report as compact JSON (route, prefill, decode, cache_id, "
                                         "retries, degradation_reason).", "required": True,
                          "schema": {"type": "string"}},
    "x-request-id": {"description": "The request's id, as in the body and the logs.", "required": True,
                     "schema": {"type": "string"}},
}
_ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"description": "`Bearer`: how to authenticate.", "schema": {"type": "string"}}},
    **{s: {"Retry-After": {"description": "Seconds after which the same request may succeed.",
                           "schema": {"type": "string", "pattern": "^[0-9]+$"}}} for s in (429, 503)},
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def request_body(model: type[BaseModel], examples: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`openapi_extra` of a route whose handler parses `model` from a JSON body; `examples` are bodies that
    work (shown by /docs, sent by the fuzz test), their `model` filled in by `install`."""
    media = {"schema": _ref(model), "examples": {name: {"summary": name, "value": body}
                                                 for name, body in examples.items()}}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


_HELLO = [{"role": "user", "content": "Say hello."}]
CHAT_EXAMPLES = {
    "a chat answer": {"model": "", "messages": _HELLO, "max_tokens": 16},
    "streamed, with usage": {"model": "", "messages": _HELLO, "max_completion_tokens": 16, "stream": True,
                             "stream_options": {"include_usage": True}},
}
COMPLETION_EXAMPLES = {
    "a text prompt": {"model": "", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
    "token ids, streamed": {"model": "", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True},
}
GENERATE_EXAMPLES = {
    "native (M5.1)": {"request_id": "req-1", "prompt": "Once upon a time", "max_tokens": 16,
                      "prefill_policy": "auto", "trace_id": "trace-1"},
    "streamed, remote prefill": {"prompt": "Once upon a time", "max_tokens": 16, "stream": True,
                                 "prefill_policy": "remote_preferred", "request_type": "batch"},
}


def _sse(chunk: type[BaseModel]) -> dict[str, Any]:
    """One Server-Sent Event: a `chunk`, an error body (a failure after the first token), or `[DONE]`."""
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorBody)]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}}}


def error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(ErrorBody)}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {**error_response(ERRORS[s]), **({"headers": _ERROR_HEADERS[s]} if s in _ERROR_HEADERS else {})}
            for s in statuses}


def responses(ok: type[BaseModel], chunk: type[BaseModel] | None = None,
              errors: tuple[int, ...] = POST_ERRORS) -> dict[int | str, dict[str, Any]]:
    """`responses` of a route: `ok` as JSON (or, with `"stream": true`, events of `chunk`) and the errors."""
    content: dict[str, Any] = {"application/json": {"schema": _ref(ok)}}
    if chunk is not None:
        content["text/event-stream"] = {"schema": _sse(chunk)}
    desc = "The answer" + (" (with `\"stream\": true`: Server-Sent Events, each one chunk, then `[DONE]`)."
                           if chunk is not None else ".")
    ok_doc = {"description": desc, "content": content, **({"headers": _ROUTE_HEADERS} if chunk else {})}
    return {200: ok_doc, **error_responses(*errors)}


def _component_schemas() -> dict[str, Any]:
    pairs = [(m, "validation") for m in _REQUESTS] + [(m, "serialization") for m in _RESPONSES]
    _, top = models_json_schema(pairs, ref_template=_REF)  # type: ignore[arg-type]
    schemas: dict[str, Any] = top["$defs"]
    # RouteInfo.as_dict() dumps every field: all are present in every answer.
    route = schemas["RouteInfo"]
    route["required"] = sorted(route["properties"])
    return schemas


def _only_model(schemas: dict[str, Any], paths: dict[str, Any], served: str) -> None:
    """The gateway serves one model: any other `model` is a 404, so the document names the one it takes."""
    for item in paths.values():
        media = item.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json", {})
        for example in media.get("examples", {}).values():
            if "model" in example["value"]:
                example["value"] = {**example["value"], "model": served}
    for model in _REQUESTS:
        prop = schemas[model.__name__]["properties"]["model"]
        if "anyOf" in prop:  # optional (/v1/generate): the name or null
            prop["anyOf"] = [{"type": "string", "enum": [served]} if b.get("type") == "string" else b
                             for b in prop["anyOf"]]
        else:
            prop["enum"] = [served]


def _shared_routes(paths: dict[str, Any]) -> None:
    """Responses of the routes every service has (crossfill.serving.health, metrics), as the gateway serves them."""
    json_of = {"application/json": {"schema": _ref(Readiness)}}
    docs = {
        "/healthz": {200: {"description": "The process answers.",
                           "content": {"application/json": {"schema": _ref(Health)}}}},
        "/readyz": {200: {"description": "Ready for traffic.", "content": json_of},
                    503: {"description": "Alive but not ready (starting, draining, scheduler unreachable); "
                                         "`reason` says why.", "content": json_of}},
        "/metrics": {200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {
                         "type": "string"}}}},
                     404: error_response("Metrics are off (inference_service.observability.metrics_enabled).")},
    }
    for path, doc in docs.items():
        if "get" in paths.get(path, {}):
            paths[path]["get"]["responses"] = {str(k): v for k, v in doc.items()}


def install(app: FastAPI, served_model: str, auth_required: bool) -> None:
    """Serve the completed document at /openapi.json (and /docs); `auth_required` marks the key as mandatory."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=_DESCRIPTION)
            components = doc.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            schemas.update(_component_schemas())
            _only_model(schemas, doc.get("paths", {}), served_model)
            components["securitySchemes"] = {SECURITY_SCHEME: {
                "type": "http", "scheme": "bearer",
                "description": "An API key (security.auth): `Authorization: Bearer <key>` (`api-key` and "
                               "`x-api-key` headers are accepted too)."}}
            # The OpenAI API under /v1 needs the key; health and metrics answer anyone (probes, Prometheus).
            needs = [{SECURITY_SCHEME: []}] if auth_required else [{SECURITY_SCHEME: []}, {}]
            for path, item in doc.get("paths", {}).items():
                for op in item.values():
                    if path.startswith("/v1/"):
                        op["security"] = needs
            _shared_routes(doc.get("paths", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
