"""Model files: the registry of known models, the model cache, and loaders the engine consumes.

The model code itself (forward passes) lives in `llama.py` and `gemma3.py`. Names are resolved
lazily so that importing this package (e.g. for the CLI) does not pay for torch/transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ChecksumMismatchError": "crossfill.models.errors",
    "ModelConfigError": "crossfill.models.errors",
    "ModelCorruptError": "crossfill.models.errors",
    "ModelDownloadError": "crossfill.models.errors",
    "ModelError": "crossfill.models.errors",
    "UnknownModelError": "crossfill.models.errors",
    "ModelFiles": "crossfill.models.files",
    "ModelInfo": "crossfill.models.files",
    "eos_token_ids": "crossfill.models.files",
    "known_models": "crossfill.models.files",
    "load_config": "crossfill.models.files",
    "load_state_dict": "crossfill.models.files",
    "load_tokenizer": "crossfill.models.files",
    "resolve_model": "crossfill.models.files",
    "DEFAULT_MODEL": "crossfill.models.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'crossfill.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
