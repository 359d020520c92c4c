"""One request through the gateway, classified the way a careful client sees it.

- completed: HTTP 200 and a final answer (finish_reason) — judged later against the reference;
- failed: an explicit error in the OpenAI schema `{"error": {"message","type","param","code"}}`,
  as the HTTP body or, after the first streamed token, as an SSE data chunk;
- lost: anything else — no answer within the deadline, a connection broken without an error, a
  body that is not the error schema (plain text), a stream that ends without a result.

The only retry is a connection that could not be opened (refused, connect timeout): nothing
reached the server, so sending again cannot run the request twice. Those retries are counted.
A new connection per request (no keep-alive) keeps that true: a request written onto a pooled
connection that the server was closing would look like a broken answer, not a refused one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from crossfill.reliability.workload import RequestSpec

Verdict = Literal["completed", "failed", "lost"]
_ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Outcome:
    spec: RequestSpec
    verdict: Verdict
    status: int | None = None
    error_code: str | None = None  # the error's "code" (or "http_<status>" when it has none)
    detail: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    finals: int = 0  # final chunks seen: more than one is a duplicated answer
    after_done: int = 0  # data chunks after the terminating [DONE]
    completion_tokens: int | None = None
    route: dict[str, Any] | None = None  # the answer's `crossfill` object
    retry_after_s: float | None = None  # what the server asked for with Retry-After
    connect_retries: int = 0
    started: float = 0.0
    ended: float = 0.0


def new_client(timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    """A client of the gateway; `api_key` (security.auth) goes in every request's Authorization header."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(timeout_s, connect=5.0), headers=headers,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


def error_schema(body: Any) -> dict[str, Any] | None:
    """The error object if `body` is the OpenAI error schema, else None."""
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) and _ERROR_KEYS <= err.keys() else None


async def send(http: httpx.AsyncClient, url: str, model: str, spec: RequestSpec, *, deadline_s: float,
               connect_budget_s: float, on_token: Callable[[RequestSpec], None] | None = None) -> Outcome:
    """Send `spec` to the gateway at `url`; never raises for what the server does."""
    out = Outcome(spec, "lost", started=time.monotonic())
    backoff = 0.1
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                try:
                    if spec.stream:
                        await _stream(http, url + spec.path, spec.body(model), out, on_token)
                    else:
                        await _post(http, url + spec.path, spec.body(model), out)
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    if time.monotonic() - out.started > connect_budget_s:
                        out.detail = f"gateway unreachable for {connect_budget_s:.0f}s: {type(exc).__name__}"
                        break
                    out.connect_retries += 1
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
    except TimeoutError:
        out.verdict, out.detail = "lost", f"no answer within {deadline_s:.0f}s"
    except httpx.HTTPError as exc:  # read errors, protocol errors, timeouts: broken without an error
        out.verdict, out.detail = "lost", f"connection broke after {len(out.token_ids)} token(s): {exc!r}"
    out.ended = time.monotonic()
    return out


def _explicit_error(out: Outcome, status: int, err: dict[str, Any], where: str) -> None:
    out.verdict = "failed"
    out.error_code = str(err.get("code") or f"http_{status}")
    out.detail = f"{status} {out.error_code} {where}: {str(err.get('message'))[:160]}"


def _not_ok(out: Outcome, status: int, raw: bytes, retry_after: str | None) -> None:
    if retry_after and retry_after.isdigit():
        out.retry_after_s = float(retry_after)
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    err = error_schema(body)
    if err is None:
        out.verdict, out.detail = "lost", f"HTTP {status} without the JSON error schema: {raw[:160]!r}"
    else:
        _explicit_error(out, status, err, "before the answer")


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome) -> None:
    r = await http.post(url, json=body)
    out.status = r.status_code
    if r.status_code != 200:
        _not_ok(out, r.status_code, r.content, r.headers.get("retry-after"))
        return
    try:
        data = r.json()
        choice = data["choices"][0]
        out.finish_reason = choice["finish_reason"]
        out.text = choice["message"]["content"] if "message" in choice else choice["text"]
        out.token_ids = list(data.get("token_ids") or [])
        out.completion_tokens = data.get("usage", {}).get("completion_tokens")
        out.route = data.get("crossfill")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        out.verdict, out.detail = "lost", f"malformed 200 answer ({exc!r}): {r.text[:160]!r}"
        return
    out.finals = 1
    out.verdict = "completed" if out.finish_reason else "lost"
    if not out.finish_reason:
        out.detail = "200 answer without a finish_reason"


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome,
                  on_token: Callable[[RequestSpec], None] | None) -> None:
    async with http.stream("POST", url, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            _not_ok(out, r.status_code, await r.aread(), r.headers.get("retry-after"))
            return
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if done:
                out.after_done += 1
                continue
            if line == "data: [DONE]":
                done = True
                continue
            try:
                chunk = json.loads(line[6:])
            except ValueError:
                out.verdict, out.detail = "lost", f"a stream chunk is not JSON: {line[:160]!r}"
                return
            _read_chunk(chunk, out, on_token)
    if out.verdict == "failed" or out.finals:
        return
    out.verdict, out.detail = "lost", f"stream ended without a result after {len(out.token_ids)} token(s)"


def _read_chunk(chunk: dict[str, Any], out: Outcome, on_token: Callable[[RequestSpec], None] | None) -> None:
    if "error" in chunk:
        err = error_schema(chunk)
        if err is None:
            out.verdict, out.detail = "lost", f"an error chunk without the schema: {str(chunk)[:160]}"
        else:
            _explicit_error(out, out.status or 0, err, f"mid-stream after {len(out.token_ids)} token(s)")
        return
    choices = chunk.get("choices") or [{}]
    choice = choices[0]
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    ids = chunk.get("token_ids") or []
    if (text or ids) and not out.token_ids and not out.text and on_token is not None:
        on_token(out.spec)
    out.text += text
    out.token_ids.extend(ids)
    if choice.get("finish_reason"):
        out.finals += 1
        out.finish_reason = choice["finish_reason"]
        out.route = chunk.get("crossfill") or out.route
        if out.verdict != "failed":
            out.verdict = "completed"
    if "usage" in chunk and chunk["usage"]:
        out.completion_tokens = chunk["usage"].get("completion_tokens")
