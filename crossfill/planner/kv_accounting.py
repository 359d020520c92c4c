"""Bytes of KV cache (and recurrent state) one request carries, layer kind by layer kind.

What prefill hands to decode is exactly what decode needs to produce the next token:

* full attention: K and V of every token, ``2 x kv_heads x head_dim`` values per token;
* sliding window: K and V of the last tokens only, capped at the window (see `SlidingKeep`);
* MLA (DeepSeek-V3, Kimi): one compressed latent of ``kv_lora_rank + qk_rope_head_dim`` values per
  token, shared by K and V;
* linear attention / recurrent layers (Gated DeltaNet, KDA, Mamba): a fixed-size state per request
  (the recurrent matrix plus the short-convolution tail), independent of the prompt length.

Sliding-window convention: a query sees itself and ``window - 1`` earlier tokens, so after prefill
decode needs the last ``window - 1`` tokens; that is what crossfill's engine keeps and sends
(`crossfill.engine.types.LayerSpec.kept_tokens`) and what the crossfill presets use
(``sliding_keep="window-1"``). Other engines commonly keep a full window of ``window`` tokens, the
default for third-party models (``sliding_keep="window"``). The difference is one token a layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from crossfill.planner.dtypes import KV_DTYPES, KVDtype

LayerKind = Literal["full", "sliding", "mla", "linear"]
SlidingKeep = Literal["window", "window-1"]
GROWING_KINDS: tuple[LayerKind, ...] = ("full", "mla")


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps per request."""

    index: int
    kind: LayerKind
    num_kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    window: int | None = None  # sliding layers: tokens a query sees, itself included
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    state_values: int = 0  # linear: elements of the fixed recurrent + convolution state

    def token_bytes(self, dtype: KVDtype) -> int:
        """Bytes one kept token costs in this layer (0 for recurrent layers)."""
        if self.kind in ("full", "sliding"):
            return self.num_kv_heads * (dtype.vector_bytes(self.k_head_dim) + dtype.vector_bytes(self.v_head_dim))
        if self.kind == "mla":
            return dtype.vector_bytes(self.latent_dim)
        return 0

    def kept_tokens(self, num_tokens: int, sliding_keep: SlidingKeep = "window") -> int:
        """Tokens of a `num_tokens` context this layer must hand to decode."""
        if self.kind == "linear":
            return 0
        if self.kind == "sliding" and self.window is not None:
            cap = self.window - 1 if sliding_keep == "window-1" else self.window
            return min(num_tokens, cap)
        return num_tokens

    def state_bytes(self, state_dtype: KVDtype) -> int:
        """Fixed per-request bytes (recurrent state); states are kept unquantised in `state_dtype`."""
        return self.state_values * state_dtype.bits // 8

    def request_bytes(
        self, num_tokens: int, dtype: KVDtype, state_dtype: KVDtype, sliding_keep: SlidingKeep = "window"
    ) -> int:
        return self.kept_tokens(num_tokens, sliding_keep) * self.token_bytes(dtype) + (
            self.state_bytes(state_dtype) if num_tokens > 0 else 0
        )


@dataclass(frozen=True)
class ModelKV:
    """A model's KV layout: one `LayerKV` per decoder layer."""

    name: str
    layers: tuple[LayerKV, ...]
    sliding_keep: SlidingKeep = "window"
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def kind_counts(self) -> dict[str, int]:
        return dict(Counter(layer.kind for layer in self.layers))

    def growing_bytes_per_token(self, dtype: KVDtype) -> int:
        """Bytes each additional token adds once sliding windows are full (full + MLA layers)."""
        return sum(layer.token_bytes(dtype) for layer in self.layers if layer.kind in GROWING_KINDS)

    def first_token_bytes(self, dtype: KVDtype) -> int:
        """Bytes one token costs across all attention layers (a short prompt, windows not yet full)."""
        return sum(layer.token_bytes(dtype) for layer in self.layers)

    def request_bytes(self, num_tokens: int, dtype: KVDtype, state_dtype: KVDtype = KV_DTYPES["bf16"]) -> int:
        """Bytes of KV + state that prefill of `num_tokens` tokens hands to decode."""
        return sum(layer.request_bytes(num_tokens, dtype, state_dtype, self.sliding_keep) for layer in self.layers)

    def breakdown(
        self, num_tokens: int, dtype: KVDtype, state_dtype: KVDtype = KV_DTYPES["bf16"]
    ) -> dict[str, int]:
        """`request_bytes` split by layer kind."""
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + layer.request_bytes(
                num_tokens, dtype, state_dtype, self.sliding_keep
            )
        return out

    def kv_function(self, dtype: KVDtype, state_dtype: KVDtype = KV_DTYPES["bf16"]) -> Callable[[np.ndarray], np.ndarray]:
        """Vectorised `request_bytes` over an array of lengths (the optimiser integrates it)."""
        growing = self.growing_bytes_per_token(dtype)
        state = sum(layer.state_bytes(state_dtype) for layer in self.layers)
        capped: Counter[tuple[int, int]] = Counter()
        for layer in self.layers:
            if layer.kind == "sliding":
                capped[(layer.kept_tokens(1 << 62, self.sliding_keep), layer.token_bytes(dtype))] += 1

        def kv(lengths: np.ndarray) -> np.ndarray:
            n = np.round(np.asarray(lengths, dtype=float))
            out = n * growing + np.where(n > 0, state, 0)
            for (cap, token_bytes), count in capped.items():
                out = out + np.minimum(n, cap) * token_bytes * count
            return out

        return kv

    def dense_equivalent(self) -> ModelKV:
        """The same model with every layer turned into its global-attention kind.

        Answers "what would the link need without the hybrid window / linear layers": sliding layers
        keep every token, linear layers become copies of the model's first full (or MLA) layer.
        """
        template = next((layer for layer in self.layers if layer.kind in GROWING_KINDS), None)
        layers = []
        for layer in self.layers:
            if layer.kind == "sliding":
                layers.append(replace(layer, kind="full", window=None))
            elif layer.kind == "linear" and template is not None:
                layers.append(replace(template, index=layer.index))
            else:
                layers.append(layer)
        return replace(self, name=f"{self.name} (all global attention)", layers=tuple(layers))

    @property
    def is_hybrid(self) -> bool:
        return any(layer.kind in ("sliding", "linear") for layer in self.layers)
