"""Service times and KV bytes, as scalar functions cheap enough to call once per simulated event.

The planner's profiles are numpy-vectorised (right for integrating over a distribution, ~10 us per
scalar call); the simulator asks for one value at a time, millions of times, so these classes
precompute the same curves into plain lists and answer with `bisect`, with exactly the planner's
semantics (tests compare them point by point).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass

import numpy as np

from crossfill.planner.dtypes import KVDtype
from crossfill.planner.kv_accounting import ModelKV
from crossfill.planner.profiles import DecodeProfile, PrefillProfile


class PrefillTime:
    """`PrefillProfile.seconds_at` for one length: linear between points, proportional below the
    first one, extrapolated along the last segment beyond the last one."""

    def __init__(self, profile: PrefillProfile) -> None:
        self.lengths = [float(x) for x in profile.lengths]
        self.seconds = [float(x) for x in profile.seconds]
        self.source = profile.source
        if len(self.lengths) > 1:
            self.last_slope = (self.seconds[-1] - self.seconds[-2]) / (self.lengths[-1] - self.lengths[-2])

    def __call__(self, tokens: float) -> float:
        L, T = self.lengths, self.seconds
        if tokens <= 0:
            return 0.0
        if len(L) == 1 or tokens < L[0]:
            return tokens * T[0] / L[0]
        if tokens >= L[-1]:
            return T[-1] + (tokens - L[-1]) * self.last_slope
        i = bisect_right(L, tokens) - 1
        return T[i] + (T[i + 1] - T[i]) * (tokens - L[i]) / (L[i + 1] - L[i])

    def uncached(self, prompt: int, cached: int) -> float:
        """Time to prefill `prompt` tokens when the first `cached` are in the prefix cache.

        T(prompt) - T(cached): the cached prefix's own work is skipped, while the new tokens still
        attend to it (so a long cached prefix makes the rest dearer than a cold short prompt).
        """
        return self(prompt) - self(cached) if cached > 0 else self(prompt)

    def tokens_per_s(self, tokens: float) -> float:
        """Throughput at `tokens` tokens: what the live scheduler would measure for such prompts."""
        return tokens / self(tokens)


class DecodeSteps:
    """Time per output token against the running batch, tabulated for every batch up to `max_batch`."""

    def __init__(self, profile: DecodeProfile, max_batch: int) -> None:
        self.max_batch = max_batch
        batches = np.arange(0, max_batch + 1, dtype=float)
        batches[0] = 1.0
        self.tpot = [float(x) for x in profile.tpot_at(batches)]  # np.interp clamps at both ends


@dataclass(frozen=True)
class KVCost:
    """Bytes a prompt's KV puts on the wire: the model's layout (window pruning, fixed recurrent
    state) as `kv_accounting` counts it, divided by the codec's compression ratio."""

    name: str
    growing_bytes_per_token: float  # full-attention and MLA layers
    state_bytes: float  # linear-attention layers: fixed per request
    capped: tuple[tuple[int, float], ...] = ()  # sliding layers: (kept tokens, bytes per token), summed
    codec_ratio: float = 1.0

    @classmethod
    def from_model(cls, model: ModelKV, dtype: KVDtype, state_dtype: KVDtype, codec_ratio: float) -> KVCost:
        capped: Counter[tuple[int, float]] = Counter()
        for layer in model.layers:
            if layer.kind == "sliding":
                capped[(layer.kept_tokens(1 << 62, model.sliding_keep), float(layer.token_bytes(dtype)))] += 1
        return cls(
            name=f"{model.name} ({dtype.name})",
            growing_bytes_per_token=float(model.growing_bytes_per_token(dtype)),
            state_bytes=float(sum(layer.state_bytes(state_dtype) for layer in model.layers)),
            capped=tuple((cap, tb * count) for (cap, tb), count in sorted(capped.items())),
            codec_ratio=codec_ratio,
        )

    def raw_bytes(self, tokens: float) -> float:
        """KV + state of a `tokens`-token context as the engine holds it (decode memory)."""
        if tokens <= 0:
            return 0.0
        out = tokens * self.growing_bytes_per_token + self.state_bytes
        for cap, token_bytes in self.capped:
            out += min(tokens, cap) * token_bytes
        return out

    def wire_bytes(self, tokens: float) -> float:
        return self.raw_bytes(tokens) / self.codec_ratio

    def send_bytes(self, prompt: int, held: int) -> float:
        """Bytes sent when decode already holds the first `held` tokens: the rest of the growing
        layers plus the whole recurrent state (a state is of the whole sequence, never partial)."""
        if held <= 0:
            return self.wire_bytes(prompt)
        return self.wire_bytes(prompt) - self.wire_bytes(held) + self.state_bytes / self.codec_ratio

    def vectorised(self, lengths: np.ndarray) -> np.ndarray:
        """`wire_bytes` over an array (the planner's optimiser integrates it over the workload)."""
        n = np.round(np.asarray(lengths, dtype=float))
        out = n * self.growing_bytes_per_token + np.where(n > 0, self.state_bytes, 0.0)
        for cap, token_bytes in self.capped:
            out = out + np.minimum(n, cap) * token_bytes
        return out / self.codec_ratio
