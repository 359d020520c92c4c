"""No response is ever a plain-text 500: even a request cancelled by a shutdown answers in the error schema."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI

from crossfill.serving.errors import install_error_handlers


def test_a_request_cancelled_before_its_response_gets_a_json_503() -> None:
    app = FastAPI()
    install_error_handlers(app)
    entered = asyncio.Event()

    @app.get("/slow")
    async def slow() -> dict[str, str]:
        entered.set()
        await asyncio.sleep(3600)
        return {}

    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": "/slow", "raw_path": b"/slow", "query_string": b"", "root_path": "",
                 "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        task = asyncio.create_task(app(scope, receive, send))
        await entered.wait()
        task.cancel()  # what uvicorn does to requests left when a graceful shutdown times out
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert dict(sent[0]["headers"])[b"content-type"] == b"application/json"
    body = json.loads(sent[1]["body"])
    assert body["error"]["code"] == "shutting_down" and body["error"]["type"] == "service_unavailable"
