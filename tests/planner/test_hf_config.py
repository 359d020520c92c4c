"""Reading real config.json shapes, and the errors bad ones give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crossfill.planner.dtypes import KV_DTYPES
from crossfill.planner.errors import PlanError
from crossfill.planner.hf_config import model_from_hf_config
from crossfill.planner.model_source import load_model, preset_data

BF16 = KV_DTYPES["bf16"]


def test_text_config_nesting_is_read(tmp_path: Path) -> None:
    config = {"model_type": "x", "text_config": {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = load_model(str(path))
    assert model.request_bytes(10, BF16) == 10 * 4 * 2 * 2 * 64 * 2
    assert load_model(str(tmp_path)).request_bytes(10, BF16) == model.request_bytes(10, BF16)  # a model dir


def test_layer_types_win_over_interval_and_mistral_style_window_applies_to_all() -> None:
    base = {"num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 16}
    typed = model_from_hf_config(
        {**base, "layer_types": ["sliding_attention", "full_attention"] * 2, "full_attention_interval": 4}, "t"
    )
    assert [layer.kind for layer in typed.layers] == ["sliding", "full", "sliding", "full"]
    assert model_from_hf_config(base, "m").kind_counts() == {"sliding": 4}
    assert model_from_hf_config({**base, "use_sliding_window": False}, "q").kind_counts() == {"full": 4}


def test_hidden_size_gives_head_dim_when_absent() -> None:
    model = model_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}, "mha")
    assert model.layers[0].num_kv_heads == 4 and model.layers[0].k_head_dim == 64


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_key_value_heads": 2, "head_dim": 64}, "missing 'num_hidden_layers'"),
        ({"num_hidden_layers": 2, "head_dim": 64}, "missing 'num_key_value_heads'"),
        ({"num_hidden_layers": 2, "num_key_value_heads": 2}, "missing 'head_dim'"),
        ({"num_hidden_layers": 2, "num_key_value_heads": 0, "head_dim": 8}, "'num_key_value_heads' is 0"),
        (
            {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8, "layer_types": ["full_attention"]},
            "must be a list of 2 entries",
        ),
        (
            {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8,
             "layer_types": ["full_attention", "sliding_attention"]},
            "missing 'sliding_window'",
        ),
        (
            {"num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 8, "full_attention_interval": 2},
            "linear-attention layers need their state size",
        ),
    ],
)
def test_incomplete_configs_name_the_missing_field(config: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        model_from_hf_config(config, "bad")


def test_unknown_preset_and_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="unknown preset 'llama-9'"):
        load_model("llama-9")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="cannot read .* as JSON"):
        load_model(str(bad))


def test_presets_are_found_by_hugging_face_id_and_cite_sources() -> None:
    assert load_model("Qwen/Qwen3-Next-80B-A3B-Instruct").name == "Qwen3-Next-80B-A3B"
    for key in ("deepseek-v3", "gemma-3-27b", "kimi-linear-48b-a3b"):
        assert preset_data(key)["sources"][0].startswith("https://huggingface.co/")


# Trimmed from https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json and
# https://huggingface.co/ai21labs/Jamba-v0.1/blob/main/config.json (KV-relevant fields only).
NEMOTRON_H_8B = {
    "model_type": "nemotron_h", "num_hidden_layers": 52, "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
}
JAMBA = {
    "model_type": "jamba", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "attn_layer_offset": 4, "attn_layer_period": 8,
    "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
}


def test_mamba2_hybrid_with_mlp_only_layers() -> None:
    model = model_from_hf_config(NEMOTRON_H_8B, "nemotron-h-8b")
    assert model.kind_counts() == {"linear": 24, "full": 4}  # the 24 MLP-only layers hold nothing
    state = 128 * 64 * 128 + (128 * 64 + 2 * 8 * 128) * 3  # heads x head_dim x d_state + conv(x, B, C)
    assert model.request_bytes(1000, BF16) == 1000 * 4 * 2 * 8 * 128 * 2 + 24 * state * 2


def test_jamba_attention_period_and_mamba1_state() -> None:
    model = model_from_hf_config(JAMBA, "jamba")
    assert [layer.index for layer in model.layers if layer.kind == "full"] == [4, 12, 20, 28]
    d_inner = 2 * 4096
    state = d_inner * 16 + d_inner * 3
    assert model.request_bytes(1000, BF16) == 1000 * 4 * 2 * 8 * 128 * 2 + 28 * state * 2
