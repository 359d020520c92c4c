"""The crossfill-served models' accounting equals what crossfill's engine allocates and sends.

The engine is built from the preset's own config values (shrunk vocabulary and MLP, which hold no
KV) so the comparison uses the engine's real `LayerSpec`s, not a copy of their arithmetic.
"""

from __future__ import annotations

import pytest

from crossfill.planner.dtypes import KV_DTYPES
from crossfill.planner.model_source import load_model, preset_data


def test_config_values_of_the_served_models() -> None:
    smol = load_model("smollm2-135m")
    assert smol.kind_counts() == {"full": 30}
    assert {(layer.num_kv_heads, layer.k_head_dim) for layer in smol.layers} == {(3, 64)}
    gemma = load_model("gemma-3-270m")
    assert [layer.kind for layer in gemma.layers] == (["sliding"] * 5 + ["full"]) * 3
    assert {(layer.num_kv_heads, layer.k_head_dim) for layer in gemma.layers} == {(1, 256)}
    assert {layer.window for layer in gemma.layers if layer.kind == "sliding"} == {512}
    assert gemma.sliding_keep == "window-1" and smol.sliding_keep == "window-1"


@pytest.mark.parametrize("preset", ["smollm2-135m", "gemma-3-270m"])
def test_accounting_equals_engine_layer_specs(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_module = pytest.importorskip("crossfill.engine.engine")
    loader = pytest.importorskip("crossfill.engine.model_loader")
    transformers = pytest.importorskip("transformers")

    # Random weights are enough: only the layout matters. Build on CPU, skip weight loading.
    monkeypatch.setattr(engine_module, "load_model", lambda config, state_dict, dtype: loader.build_model(config, dtype))
    fields = {k: v for k, v in preset_data(preset)["config"].items() if k not in ("architectures", "torch_dtype")}
    fields.update(vocab_size=64, intermediate_size=8)
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    engine = engine_module.LLMEngine(hf_config, {}, None, engine_config=engine_module.EngineConfig(kv_memory_mb=8))

    model = load_model(preset)
    for tokens in (1, 100, 510, 511, 512, 513, 4096):
        sent_by_engine = sum(spec.kept_tokens(tokens) * spec.bytes_per_token for spec in engine.layer_specs)
        assert model.request_bytes(tokens, KV_DTYPES["fp32"]) == sent_by_engine, tokens
