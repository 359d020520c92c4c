"""KV bytes of every preset, computed by hand from the public config numbers."""

from __future__ import annotations

import pytest

from crossfill.planner.dtypes import KV_DTYPES, kv_dtype
from crossfill.planner.errors import PlanError
from crossfill.planner.model_source import load_model, preset_names

BF16, FP32 = KV_DTYPES["bf16"], KV_DTYPES["fp32"]


def gqa(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int = 2) -> int:
    """K + V bytes one token adds across `layers` grouped-query layers."""
    return layers * 2 * kv_heads * head_dim * bytes_per_value


# (preset, expected bytes for a request of n tokens, bf16 KV, bf16 states), from the configs by hand.
GDN_STATE = 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3  # Qwen3-Next: value heads x k x v + conv tail
KDA_STATE = 32 * 128 * 128 + 3 * 32 * 128 * 3  # Kimi: heads x dim x dim + q/k/v conv tails
HAND = {
    "llama-3.1-8b": lambda n: n * gqa(32, 8, 128),
    "llama-3.1-70b": lambda n: n * gqa(80, 8, 128),
    "qwen3-235b-a22b": lambda n: n * gqa(94, 4, 128),
    "minimax-m2": lambda n: n * gqa(62, 8, 128),
    "deepseek-v3": lambda n: n * 61 * (512 + 64) * 2,
    "qwen3-next-80b-a3b": lambda n: n * gqa(12, 2, 256) + 36 * GDN_STATE * 2,
    "kimi-linear-48b-a3b": lambda n: n * 7 * (512 + 64) * 2 + 20 * KDA_STATE * 2,
    # MiMo: 9 global layers 4 KV heads, 39 sliding layers 8 KV heads, K 192 + V 128, window 128.
    "mimo-v2-flash": lambda n: n * 9 * 4 * (192 + 128) * 2 + min(n, 128) * 39 * 8 * (192 + 128) * 2,
    "gemma-3-27b": lambda n: n * gqa(10, 16, 128) + min(n, 1024) * gqa(52, 16, 128),
    "smollm2-135m": lambda n: n * gqa(30, 3, 64),
    # crossfill's engine keeps window - 1 = 511 tokens in Gemma 3 270M's sliding layers.
    "gemma-3-270m": lambda n: n * gqa(3, 1, 256) + min(n, 511) * gqa(15, 1, 256),
}


def test_every_preset_has_a_hand_computed_check() -> None:
    assert sorted(HAND) == sorted(preset_names())


@pytest.mark.parametrize("preset", sorted(HAND))
@pytest.mark.parametrize("tokens", [1, 127, 128, 129, 511, 512, 1024, 1025, 32768, 131072])
def test_request_bytes_match_hand_computation(preset: str, tokens: int) -> None:
    assert load_model(preset).request_bytes(tokens, BF16) == HAND[preset](tokens)


@pytest.mark.parametrize("preset", sorted(HAND))
def test_vectorised_kv_function_agrees(preset: str) -> None:
    import numpy as np

    model = load_model(preset)
    lengths = np.array([1, 127, 128, 511, 512, 1024, 1025, 65536])
    assert model.kv_function(BF16)(lengths).tolist() == [HAND[preset](int(n)) for n in lengths]


def test_layer_counts_of_hybrids() -> None:
    assert load_model("qwen3-next-80b-a3b").kind_counts() == {"linear": 36, "full": 12}
    assert load_model("kimi-linear-48b-a3b").kind_counts() == {"linear": 20, "mla": 7}
    assert load_model("mimo-v2-flash").kind_counts() == {"full": 9, "sliding": 39}
    assert load_model("gemma-3-27b").kind_counts() == {"sliding": 52, "full": 10}
    assert load_model("gemma-3-270m").kind_counts() == {"sliding": 15, "full": 3}


def test_quantised_dtypes_count_their_scales() -> None:
    llama = load_model("llama-3.1-8b")
    vectors = 32 * 8 * 2  # per token: layers x kv heads x (K, V)
    assert llama.growing_bytes_per_token(kv_dtype("fp8")) == vectors * 128  # per-tensor scale only
    assert llama.growing_bytes_per_token(kv_dtype("int8")) == vectors * (128 + 2)  # fp16 scale per vector
    assert llama.growing_bytes_per_token(kv_dtype("int4")) == vectors * (64 + 4 * 4)  # 4 groups of 32
    # MLA latent of 576 values in int4: 288 bytes + 18 groups x (scale + zero point).
    assert load_model("deepseek-v3").growing_bytes_per_token(kv_dtype("int4")) == 61 * (288 + 18 * 4)


def test_states_use_their_own_dtype_and_do_not_grow() -> None:
    model = load_model("qwen3-next-80b-a3b")
    fp32_states = model.request_bytes(1000, BF16, FP32) - model.request_bytes(1000, BF16, BF16)
    assert fp32_states == 36 * GDN_STATE * 2
    assert model.breakdown(10, BF16)["linear"] == model.breakdown(100000, BF16)["linear"]


def test_dense_equivalent_removes_the_hybrid_saving() -> None:
    gemma = load_model("gemma-3-27b")
    assert gemma.dense_equivalent().request_bytes(4096, BF16) == 4096 * gqa(62, 16, 128)
    qwen = load_model("qwen3-next-80b-a3b").dense_equivalent()
    assert qwen.request_bytes(4096, BF16) == 4096 * gqa(48, 2, 256)
    assert not qwen.is_hybrid


def test_unknown_dtype_names_the_flag() -> None:
    with pytest.raises(PlanError, match="--dtype: unknown KV dtype 'fp6'"):
        kv_dtype("fp6")
