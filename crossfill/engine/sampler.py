"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws from a generator keyed by (seed, position), so a token sampled on a
remote prefill instance and the tokens sampled later on the decode instance are the same as
in one colocated run.
"""

from __future__ import annotations

import torch

from crossfill.engine.sampling import SamplingParams


def _generator(seed: int, position: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample_one(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token for `position` from a [vocab] float32 logits row."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = cumulative - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = _generator(params.seed, position) if params.seed is not None else None
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """Rows of [n, vocab] logits -> one token each; greedy rows share one argmax."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_one(logits[i], p, pos) for i, (p, pos) in enumerate(zip(params, positions, strict=True))]
