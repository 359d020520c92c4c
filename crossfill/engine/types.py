"""Data types the engine shares with the KV transfer layer and the serving workers.

These are the contract between the engine (prefill-only / decode-only modes), the KV wire
format and the workers; they carry no behaviour beyond light validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

LayerKind = Literal["full", "sliding"]


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer keeps in its KV cache."""

    index: int
    kind: LayerKind
    window: int | None  # sliding window in tokens (a query sees itself and window-1 earlier tokens)
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token occupies in this layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def kept_tokens(self, num_tokens: int) -> int:
        """Tokens of a `num_tokens` context this layer needs to decode the next token."""
        if self.kind == "sliding" and self.window is not None:
            return min(num_tokens, self.window - 1)
        return num_tokens


@dataclass
class LayerKVChunk:
    """K and V of one layer for the absolute token positions [start, start + len)."""

    layer: int
    start: int
    k: torch.Tensor  # [tokens, num_kv_heads, head_dim], contiguous, owned by the receiver
    v: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + int(self.k.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[0])


@dataclass
class PrefillOutput:
    """What prefill-only mode hands to decode besides the KV."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int  # sampled from the last prompt position with the request's SamplingParams
    logits: torch.Tensor  # [vocab] float32 logits of the last prompt position
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    """Incremental output of one request after an engine step."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""  # detokenised delta; never ends inside a UTF-8 character
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0
    prefill: PrefillOutput | None = None  # set once, in prefill-only mode, when prefill is done
    error: str | None = None


@dataclass
class KVStats:
    blocks_total: int
    blocks_used: int
    blocks_cached: int  # unreferenced blocks kept for prefix reuse (evictable)
    active_requests: int
    preemptions: int = 0  # cumulative: running requests that gave their blocks back to be recomputed
    out_of_kv_finishes: int = 0  # cumulative: requests ended with "length" because no block could ever be freed

    def as_dict(self) -> dict[str, int]:
        return {
            "blocks_total": self.blocks_total,
            "blocks_used": self.blocks_used,
            "blocks_cached": self.blocks_cached,
            "active_requests": self.active_requests,
            "preemptions": self.preemptions,
            "out_of_kv_finishes": self.out_of_kv_finishes,
        }


class NoKVCapacityError(RuntimeError):
    """Not enough free KV blocks to admit the request now; retry later or elsewhere."""
