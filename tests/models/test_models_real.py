"""The two registry models, pulled for real (once; later runs reuse $CROSSFILL_HOME's cache).

Checks that what the cache holds is a complete Hugging Face model that transformers loads with
no missing or unexpected weights, and that it continues text sensibly under greedy decoding,
which fails loudly if a dequantisation or q/k-permutation step went wrong.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from crossfill.models import eos_token_ids, load_config, load_state_dict, load_tokenizer, resolve_model

pytestmark = pytest.mark.realmodel


class _Greedy:
    """The cached model loaded by transformers itself (must load with no missing/unexpected keys)."""

    def __init__(self, files) -> None:
        self.model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(files.path), dtype=torch.float32, output_loading_info=True
        )
        assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
        self.tokenizer = load_tokenizer(files)

    def __call__(self, prompt: str, tokens: int) -> str:
        ids = self.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**ids, max_new_tokens=tokens, do_sample=False)
        return self.tokenizer.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


def _check_common(files) -> None:
    config = load_config(files)
    state = load_state_dict(files)
    with torch.device("meta"):  # parameter names only; no memory, no random init
        skeleton = set(transformers.AutoModelForCausalLM.from_config(config).state_dict())
    assert set(state) == skeleton - {"lm_head.weight"}  # tied embeddings stored once
    assert all(t.dtype == torch.float32 for t in state.values())
    assert resolve_model(files.name, pull=False).fingerprint == files.fingerprint  # stable across loads


def test_smollm2_135m() -> None:
    files = resolve_model("smollm2-135m")
    _check_common(files)
    config = load_config(files)
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)
    tokenizer = load_tokenizer(files)
    assert eos_token_ids(files) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    greedy = _Greedy(files)
    assert "Paris" in greedy("The capital of France is", 6)
    assert greedy("1, 2, 3, 4, 5,", 6).startswith(" 6, 7")


def test_gemma3_270m() -> None:
    files = resolve_model("gemma3-270m")
    _check_common(files)
    config = load_config(files)
    assert config.model_type == "gemma3_text"
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256 and config.head_dim == 256
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    tokenizer = load_tokenizer(files)
    ids = eos_token_ids(files)
    assert ids == [tokenizer.convert_tokens_to_ids("<eos>"), tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    greedy = _Greedy(files)
    assert greedy("1, 2, 3, 4, 5,", 6).startswith(" 6, 7")
    assert "Lily" in greedy("Once upon a time, there was a little girl named", 3)
