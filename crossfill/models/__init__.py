"""Model files: the registry of known models, the model cache, and loaders the engine consumes.

The model code itself (forward passes) lives in `llama.py` and `gemma3.py`.
"""

from __future__ import annotations

from crossfill.models.errors import (
    ChecksumMismatchError,
    ModelConfigError,
    ModelCorruptError,
    ModelDownloadError,
    ModelError,
    UnknownModelError,
)
from crossfill.models.files import (
    ModelFiles,
    ModelInfo,
    eos_token_ids,
    known_models,
    load_config,
    load_state_dict,
    load_tokenizer,
    resolve_model,
)
from crossfill.models.registry import DEFAULT_MODEL

__all__ = [
    "DEFAULT_MODEL",
    "ChecksumMismatchError",
    "ModelConfigError",
    "ModelCorruptError",
    "ModelDownloadError",
    "ModelError",
    "ModelFiles",
    "ModelInfo",
    "UnknownModelError",
    "eos_token_ids",
    "known_models",
    "load_config",
    "load_state_dict",
    "load_tokenizer",
    "resolve_model",
]
