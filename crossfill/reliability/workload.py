"""What the harnesses send: prompts sized against the routing threshold, and one spec per request.

A small pool of distinct prompts keeps the greedy reference cheap to compute; every request still
has its own request id and its own tenant, so no request reuses another's KV (each remote request
moves its whole KV over the WAN, where the faults are) and every answer can be told apart. The
turns of one multi-turn chat share a tenant on purpose: the second turn's decode already holds
the first turn's KV, the reuse path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Policy = Literal["auto", "local_only", "remote_preferred", "remote_required"]

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Prefill is compute bound; decode is memory bandwidth bound.",
    "KV caches cross datacenters over ordinary Ethernet links.",
    "Hello world! Text, numbers 12345 and punctuation are fine.",
    "A scheduler routes each request to a prefill and a decode instance.",
    "Links between datacenters are slower and less reliable than racks.",
)


@dataclass(frozen=True)
class Prompt:
    """A prompt of the pool: plain text for /v1/generate, or chat messages for /v1/chat/completions."""

    key: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: Prompt
    max_tokens: int
    policy: Policy
    stream: bool
    tenant: str

    @property
    def ref_key(self) -> tuple[str, int]:
        return self.prompt.key, self.max_tokens

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.prompt.is_chat else "/v1/generate"

    def body(self, model: str) -> dict[str, Any]:
        # ignore_eos: every answer has exactly max_tokens tokens, so a repeated stream shows.
        common = {"max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": self.stream,
                  "prefill_policy": self.policy, "tenant_id": self.tenant}
        if self.prompt.messages is not None:
            messages = [{"role": r, "content": c} for r, c in self.prompt.messages]
            return {**common, "model": model, "messages": messages, "stream_options": {"include_usage": True}}
        return {**common, "request_id": self.request_id, "prompt": self.prompt.text}


@dataclass(frozen=True)
class PromptPool:
    short: tuple[Prompt, ...]  # below the routing threshold: prefilled locally under "auto"
    long: tuple[Prompt, ...]  # above it: prefilled remotely under "remote_preferred"
    chats: tuple[tuple[str, ...], ...] = ()  # user turns of each multi-turn chat (assistant turns: the reference)


def build_pool(tokenizer: Any, threshold_tokens: int, max_model_len: int, max_tokens: int,
               n_short: int = 3, n_long: int = 4, n_chats: int = 2) -> PromptPool:
    """Prompts sized with the served model's tokenizer: short ones under `threshold_tokens`, long
    ones a quarter above it (and within the context with room for `max_tokens`)."""
    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    long_target = threshold_tokens + max(threshold_tokens // 4, 8)
    if long_target + 2 * max_tokens >= max_model_len:
        raise ValueError(f"a long prompt of {long_target} tokens plus {max_tokens} tokens does not fit the "
                         f"context of {max_model_len}: lower routing.long_context_threshold_tokens or max_tokens")
    short = []
    for i in range(n_short):
        words = f"Question {i}: {_SENTENCES[i % len(_SENTENCES)]}".split()
        while count(" ".join(words)) >= threshold_tokens and len(words) > 2:
            words.pop()
        short.append(Prompt(f"short-{i}", text=" ".join(words)))
    long = [Prompt(f"long-{i}", text=_grow(f"Document {i}:", i, long_target, count)) for i in range(n_long)]
    chats = tuple((_grow(f"Chat {i}. Summarise:", i + 3, long_target, count), "Say it again, shorter.")
                  for i in range(n_chats))
    return PromptPool(tuple(short), tuple(long), chats)


def _grow(head: str, start: int, min_tokens: int, count: Callable[[str], int]) -> str:
    parts = [head]
    for k in itertools.count(start):
        if count(" ".join(parts)) >= min_tokens:
            break
        parts.append(_SENTENCES[k % len(_SENTENCES)])
    return " ".join(parts)


def chat_prompt(chat: int, turns: list[tuple[str, str]]) -> Prompt:
    """The prompt of one chat turn: `turns` is [(role, content), ...] ending with the user's message."""
    return Prompt(f"chat-{chat}-turn-{sum(r == 'user' for r, _ in turns)}", messages=tuple(turns))


@dataclass
class Mix:
    """A repeating pattern of request shapes; `next_job()` yields the specs of one job to run in order
    (one request, or the turns of a chat)."""

    pool: PromptPool
    pattern: tuple[tuple[str, Policy, bool, int], ...]  # (kind "short"/"long"/"chat", policy, stream, max_tokens)
    run_id: str = "run"
    chat_turns: dict[int, list[Prompt]] = field(default_factory=dict)  # filled by the reference
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def next_job(self) -> list[RequestSpec]:
        n = next(self._ids)
        kind, policy, stream, max_tokens = self.pattern[n % len(self.pattern)]
        rid = f"{self.run_id}-{n}"
        if kind == "chat":
            chat = (n // len(self.pattern)) % max(len(self.chat_turns), 1)
            return [RequestSpec(f"{rid}-t{t}", p, max_tokens, policy, stream, f"{rid}-chat")
                    for t, p in enumerate(self.chat_turns.get(chat, []))]
        prompts = self.pool.short if kind == "short" else self.pool.long
        prompt = prompts[(n // len(self.pattern)) % len(prompts)]
        return [RequestSpec(rid, prompt, max_tokens, policy, stream, rid)]

    def shapes(self) -> set[tuple[Prompt, int]]:
        """Every (generate prompt, max_tokens) this mix can send: what the reference must cover."""
        out: set[tuple[Prompt, int]] = set()
        for kind, _, _, max_tokens in self.pattern:
            if kind != "chat":
                out |= {(p, max_tokens) for p in (self.pool.short if kind == "short" else self.pool.long)}
        return out

    def chat_max_tokens(self) -> int | None:
        return next((m for kind, _, _, m in self.pattern if kind == "chat"), None)
