"""Dequantise a GGUF file into a Hugging Face model directory (done once per model).

transformers does the GGUF work: its GGUF loader maps llama.cpp tensor names to Hugging Face
parameter names, undoes llama.cpp's q/k row permutation for Llama and the `+1` it bakes into
Gemma's RMSNorm weights, and converts the GGUF vocabulary into a `tokenizers` tokenizer. We
build the model skeleton on the meta device only to learn the parameter names, so no random
initialisation is paid for and `accelerate` is not needed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors.torch import save_file

from crossfill.models.errors import ModelCorruptError
from crossfill.models.fetch import say

# Tokens that end an assistant turn in common chat formats; each one the vocabulary contains is
# added to generation_config's eos_token_id list, beside the GGUF's own eos token.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def gguf_metadata(path: Path) -> dict[str, Any]:
    """A few scalar metadata fields (architecture, name, context length) without the vocabulary."""
    reader = open_gguf(path)
    wanted = ("general.architecture", "general.name", "general.size_label")
    out: dict[str, Any] = {}
    for key in wanted:
        field = reader.fields.get(key)
        if field is not None:
            out[key] = field.contents()
    out["tensor_count"] = len(reader.tensors)
    return out


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning parser failures into an error that names the file and the fix."""
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on bad input
        raise ModelCorruptError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}). It is truncated or "
            "corrupt: download it again (for a registry model: `crossfill models pull NAME --force`)."
        ) from exc


def gguf_to_hf(gguf_path: Path, out: Path, fallback_chat_template: str | None = None) -> None:
    """Write config.json, model.safetensors (fp32), tokenizer files and generation_config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = gguf_path.resolve()
    open_gguf(gguf_path)  # fail early with a clear message on a truncated file
    out.mkdir(parents=True, exist_ok=True)
    where, name = str(gguf_path.parent), gguf_path.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            say(f"Reading {name} metadata")
            config = AutoConfig.from_pretrained(where, gguf_file=name)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            say(f"Dequantising {name} to float32")
            parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                          torch_dtype=torch.float32)
        except ModelCorruptError:
            raise
        except Exception as exc:
            raise ModelCorruptError(
                f"cannot convert {gguf_path} ({type(exc).__name__}: {exc}). The file is corrupt or its "
                "architecture is not supported by the installed transformers; download it again "
                "(registry model: `crossfill models pull NAME --force`)."
            ) from exc
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    _check_complete(skeleton, tensors, gguf_path)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    del tensors, parsed

    say(f"Converting the {name} tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    if not tokenizer.chat_template and fallback_chat_template:
        tokenizer.chat_template = fallback_chat_template
    tokenizer.model_max_length = int(config.max_position_embeddings)
    # Keep the template inside tokenizer_config.json, where transformers 4.x and 5.x both read it.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    _tidy_tokenizer_config(out / "tokenizer_config.json")

    eos_ids = _eos_ids(tokenizer)
    config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(str(out))
    _add_legacy_rope_keys(out / "config.json")
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out))


def _check_complete(skeleton: torch.nn.Module, tensors: dict[str, torch.Tensor], gguf_path: Path) -> None:
    """Every parameter of the model must come from the file (tied lm_head excepted)."""
    tied = set(getattr(skeleton, "_tied_weights_keys", None) or ()) if skeleton.config.tie_word_embeddings else set()
    expected = {k for k in skeleton.state_dict() if k not in tied}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ModelCorruptError(
            f"{gguf_path} does not hold a complete {skeleton.config.model_type} model: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}. Use an unmodified GGUF export of the model."
        )


def _eos_ids(tokenizer: Any) -> list[int]:
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        if token in vocab and vocab[token] not in ids:
            ids.append(int(vocab[token]))
    return ids


def _tidy_tokenizer_config(path: Path) -> None:
    """Drop keys that only describe how this process loaded the tokenizer."""
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def _add_legacy_rope_keys(path: Path) -> None:
    """Add transformers-4.x rope keys beside 5.x's `rope_parameters`, so either version reads the file.

    transformers 5 keeps per-layer-type rope settings in `rope_parameters`; 4.x (and readers of
    Gemma 3 configs written by it) expect `rope_theta` and, for Gemma 3, `rope_local_base_freq`.
    """
    data = json.loads(path.read_text())
    data.pop("_model_name_or_path", None)
    rope = data.get("rope_parameters")
    if isinstance(rope, dict):
        if "full_attention" in rope:  # per-layer-type form (Gemma 3)
            data.setdefault("rope_theta", rope["full_attention"].get("rope_theta"))
            if "sliding_attention" in rope:
                data.setdefault("rope_local_base_freq", rope["sliding_attention"].get("rope_theta"))
        elif "rope_theta" in rope:
            data.setdefault("rope_theta", rope["rope_theta"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
