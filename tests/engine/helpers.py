"""Helpers for engine tests: build a small engine, run it to completion, collect tokens."""

from __future__ import annotations

from crossfill.engine.engine import EngineConfig, LLMEngine


def make_engine(path, **kw) -> LLMEngine:
    cfg = dict(kv_memory_mb=16, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine.from_model(str(path), EngineConfig(**cfg))


def run_all(engine: LLMEngine) -> dict[str, list]:
    """Step until idle; request id -> list of RequestOutput deltas."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]
