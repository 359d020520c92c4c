"""crossfill: cross-datacenter prefill/decode disaggregated LLM serving."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy: `import crossfill` must not pay for torch
    if name == "LLM":
        from crossfill.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from crossfill.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
