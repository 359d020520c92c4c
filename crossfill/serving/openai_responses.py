"""Response bodies the gateway sends, as models: the OpenAI shapes, /v1/generate's, and the error body.

The gateway builds its bodies as plain dicts on the hot path (crossfill.serving.gateway); these
models are their written contract, used to publish the OpenAPI document (openapi_doc) and by the
tests that check real responses against it. A field without a default is always present; a field
with one may be left out. `crossfill` is the route report (protocol.RouteInfo) on every answer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from crossfill.serving.protocol import RouteInfo

# What decode reports when a request ends (crossfill.engine.types); None while it runs.
FinishReason = Literal["stop", "length", "abort", "error"] | None


class _Body(BaseModel):
    # Clients must tolerate fields added later (OpenAI adds them too).
    model_config = ConfigDict(extra="allow")


class Usage(_Body):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Body):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1, max_length=1)
    usage: Usage
    crossfill: RouteInfo


class ChatDelta(_Body):
    role: Literal["assistant"] = "assistant"  # the first chunk only
    content: str = ""  # left out when the chunk carries no text


class ChatChunkChoice(_Body):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: None
    finish_reason: FinishReason


class ChatCompletionChunk(_Body):
    """One `data:` event of a streamed chat; the last one (finish_reason set) carries `crossfill`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(min_length=1, max_length=1)
    usage: Usage | None = None  # on the last chunk with stream_options.include_usage
    crossfill: RouteInfo | None = None


class TextChoice(_Body):
    index: int = Field(ge=0)
    text: str
    logprobs: None
    finish_reason: FinishReason


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice] = Field(min_length=1, max_length=1)
    usage: Usage
    crossfill: RouteInfo


class CompletionChunk(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice] = Field(min_length=1, max_length=1)
    usage: Usage | None = None
    crossfill: RouteInfo | None = None


class GenerateResponse(Completion):
    """/v1/generate: a text completion plus the native fields (M5.1) at the top level."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason


class GenerateChunk(CompletionChunk):
    token_ids: list[int] = []  # the tokens of this chunk's text; absent on the final chunk


class Model(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Body):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Body):
    """Every refusal and failure (crossfill.serving.errors.APIError), also as the last event of a broken stream."""

    error: ErrorDetail
    crossfill: RouteInfo | None = None  # where the request got before it failed, when it was routed


class Health(_Body):
    status: Literal["ok"]
    role: str
    instance: str
    uptime_s: float


class Readiness(_Body):
    ready: bool
    reason: str
    role: str
    instance: str
