"""Build a crossfill model for a transformers config and load its weights."""

from __future__ import annotations

import torch

from crossfill.models.gemma3 import build_gemma3
from crossfill.models.llama import DecoderLM, build_llama

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


def build_model(config, dtype: torch.dtype = torch.float32) -> DecoderLM:
    """The right crossfill model for a transformers config, or an error naming what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":
        return build_gemma3(config.get_text_config(), dtype)
    if model_type == "gemma3_text":
        return build_gemma3(config, dtype)
    if model_type in ("llama", "mistral", "qwen2", "qwen3"):
        return build_llama(config, dtype)
    raise ValueError(
        f"model_type {model_type!r} is not supported; crossfill runs {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def load_model(config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> DecoderLM:
    from transformers.initialization import no_init_weights

    with no_init_weights():  # the weights are about to be overwritten: skip random init
        model = build_model(config, dtype).to(dtype)
    model.load_weights({k: v.to(dtype) for k, v in state_dict.items()})
    model.eval()
    return model
