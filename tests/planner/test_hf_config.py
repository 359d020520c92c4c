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
