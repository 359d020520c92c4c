"""`--calibrate`: measure prefill time and KV bytes of crossfill's own engine on this machine.

The engine is imported lazily (it pulls in torch and the model files); `measure_prefill` is the
only place the planner touches it, so everything else runs without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from crossfill.planner.errors import PlanError
from crossfill.planner.profiles import PrefillProfile

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048)
Measurement = tuple[int, float, int]  # (prompt tokens, prefill seconds, KV bytes handed out)


def measure_prefill(model_name: str, lengths: Sequence[int]) -> list[Measurement]:
    """Prefill one prompt of each length in prefill-only mode; time it and count the KV it emits.

    Each prompt is random token ids, so the prefix cache cannot shorten the run; one short warm-up
    prefill runs first so one-off start-up costs are not charged to the first length.
    """
    try:
        from crossfill.engine.engine import EngineConfig, LLMEngine
        from crossfill.engine.sampling import SamplingParams
    except ImportError as exc:
        raise PlanError(f"--calibrate: crossfill's engine is not available ({exc}); use --prefill-tps or --profile") from exc
    if not lengths or any(int(n) <= 0 for n in lengths):
        raise PlanError("--calibrate-lengths: expected positive prompt lengths")
    longest = max(int(n) for n in lengths)
    config = EngineConfig(
        max_num_batched_tokens=longest, max_model_len=None, enable_prefix_caching=False, max_num_seqs=1,
        kv_memory_mb=max(512, longest // 4),
    )
    try:
        engine = LLMEngine.from_model(model_name, config)
    except Exception as exc:  # model missing, not pulled, unsupported: all an input problem here
        raise PlanError(f"--calibrate: cannot start crossfill's engine for {model_name!r}: {exc}") from exc
    rng = np.random.default_rng(0)

    def run(request_id: str, n: int) -> tuple[float, int]:
        sent = [0]

        def sink(chunk) -> None:
            sent[0] += chunk.k.numel() * chunk.k.element_size() + chunk.v.numel() * chunk.v.element_size()

        tokens = rng.integers(10, engine.vocab_size - 1, size=n).tolist()
        engine.add_request(request_id, tokens, SamplingParams(max_tokens=1), prefill_only=True, kv_sink=sink)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start, sent[0]

    run("calibrate-warmup", min(32, longest))
    return [(int(n), *run(f"calibrate-{n}", int(n))) for n in sorted(set(int(x) for x in lengths))]


def calibrated_profile(
    model_name: str,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    measure: Callable[[str, Sequence[int]], list[Measurement]] = measure_prefill,
) -> PrefillProfile:
    """A prefill profile from measurements (validated like a YAML profile)."""
    rows = measure(model_name, lengths)
    return PrefillProfile.from_mapping(
        {
            "lengths": [r[0] for r in rows],
            "seconds": [r[1] for r in rows],
            "kv_bytes": [r[2] for r in rows],
            "source": f"calibrated: crossfill engine, {model_name}, this machine",
        },
        "calibration",
    )
