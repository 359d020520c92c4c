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


def prefill_remote(engine: LLMEngine, rid: str, prompt: list[int], params, *, namespace: str = "",
                   export_from: int = 0):
    """Prefill-only on `engine`; returns (exported chunks in order, PrefillOutput)."""
    chunks: list = []
    engine.add_request(rid, prompt, params, namespace=namespace, prefill_only=True, kv_sink=chunks.append,
                       export_from=export_from)
    result = run_all(engine)[rid][-1].prefill
    assert result is not None
    return chunks, result


def import_into(engine: LLMEngine, rid: str, prompt: list[int], params, chunks, first_token: int, **kw):
    """Decode-only admission + every chunk + commit; returns the Sequence."""
    seq = engine.import_request(rid, prompt, params, **kw)
    for chunk in chunks:
        engine.write_kv(rid, chunk)
    engine.commit_import(rid, first_token)
    return seq
