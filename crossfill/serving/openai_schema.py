"""Request bodies the gateway accepts: OpenAI chat/completions and the seed's native /v1/generate.

Numbers and booleans are strict (`"16"` is not a max_tokens) because a silently coerced value
is a client bug hidden from its author. Unknown extra fields are ignored, as OpenAI clients send
optional ones we do not implement; fields we know but cannot honour (n > 1) are refused by name.
`prefill_policy`, `tenant_id` and `trace_id` are accepted on every endpoint (M5.1).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

PrefillPolicyField = Literal["auto", "local_only", "remote_preferred", "remote_required"]
# Ids travel in HTTP headers (x-request-id), log lines and KV manifests: printable ASCII without
# spaces, so no client breaks a response header (a dropped connection, a 502) or forges a log line.
RequestId = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[!-~]+$")]
# A tenant as security.auth names one (crossfill.config.DevKeyConfig.tenant).
TenantId = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]


# The rules the validators below enforce (with messages that name them), published in the gateway's
# OpenAPI document so a generated request follows them too.
_STOP_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
    {"type": "null"}]}
_PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}]}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingFields(_Lenient):
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = Field(None, json_schema_extra=_STOP_SCHEMA)
    ignore_eos: StrictBool = False
    n: StrictInt = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    prefill_policy: PrefillPolicyField = "auto"
    tenant_id: TenantId | None = None
    trace_id: RequestId | None = None
    # interactive (TTFT matters) or batch (may wait for spare remote capacity); None: the
    # tenant's default from inference_service.routing.tenants (interactive).
    request_type: Literal["interactive", "batch"] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    def sampling_kwargs(self, default_temperature: float = 1.0) -> dict[str, Any]:
        return {
            "temperature": default_temperature if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "top_k": -1 if self.top_k is None else self.top_k,
            "seed": self.seed,
            "stop": list(self.stop or []),
            "ignore_eos": self.ignore_eos,
        }


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class TextPart(_Lenient):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    model: StrictStr
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    model: StrictStr
    # A string, or token ids (OpenAI allows both); a batch of prompts is not supported (one request, one route).
    prompt: StrictStr | list[StrictInt] | list[StrictStr] = Field(json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: StrictInt = Field(16, ge=1)
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):  # type: ignore[operator]
            raise ValueError("token ids must be >= 0")
        return v  # type: ignore[return-value]


class GenerateRequest(SamplingFields):
    """The seed's native request (M5.1): request_id, prompt, max_tokens, stream, prefill_policy, tenant_id, trace_id."""

    request_id: RequestId | None = None
    prompt: StrictStr = Field(min_length=1)
    max_tokens: StrictInt = Field(16, ge=1)
    model: StrictStr | None = None


SamplingFields.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
GenerateRequest.model_rebuild()
