"""Sampling parameters: validated at construction so bad values fail early with the field named."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample greedily: dividing float32 logits by a smaller one overflows them
# to inf (NaN probabilities), and the distribution it means is the argmax anyway.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {why}")

        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (-1 or 0 disables it)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be an integer > 0")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
