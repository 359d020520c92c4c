"""Tiny random-weight models saved as Hugging Face directories, built in milliseconds for tests.

Each directory holds config.json, model.safetensors and a byte-level BPE tokenizer trained on a
few sentences, so it goes through the same loading path as a real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill is compute bound; decode is memory bandwidth bound.",
    "KV caches cross datacenters over ordinary Ethernet links.",
    "Hello world! Ünïcödé text, emojis 🚀 and numbers 12345 are fine.",
]

ARCHS = ("llama", "gemma3")


def _tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def tiny_config(arch: str, vocab_size: int) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=24,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    raise ValueError(arch)


def make_tiny_model(directory: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random model of `arch` into `directory` and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(vocab_size=384)
    config = tiny_config(arch, len(tokenizer))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Spread the random logits so greedy decoding is not decided by float noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    return directory
