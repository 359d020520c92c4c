"""Gemma 3 text decoder: interleaved sliding-window and global attention (the hybrid-attention case).

Differences from Llama that matter for parity with transformers: (1 + weight) RMSNorms, q/k norms,
extra pre/post feed-forward norms and a post-attention norm applied before the residual add,
embeddings scaled by sqrt(hidden), `query_pre_attn_scalar` for the attention scale, and separate
RoPE tables for local (sliding) and global layers.
"""

from __future__ import annotations

import torch
from torch import nn

from crossfill.models.llama import (
    Attention,
    DecoderBody,
    DecoderLM,
    GatedMLP,
    LayerAttentionSpec,
    RMSNorm,
    RotaryTable,
    rotary_from_transformers,
)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, x, cos, sin, backend, layer: int) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, backend, layer)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


def build_gemma3(config, dtype: torch.dtype = torch.float32) -> DecoderLM:
    """Gemma 3 text model from a transformers Gemma3TextConfig."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = config.num_key_value_heads
    head_dim = config.head_dim
    eps = config.rms_norm_eps
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("Gemma 3 configs with attn_logit_softcapping are not supported (Gemma 2 style)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional Gemma 3 (embedding) configs are not causal LMs")

    def qk_norm(dim: int) -> RMSNorm:
        return RMSNorm(dim, eps, offset=1.0)

    layer_types = list(config.layer_types)
    layers = [
        Gemma3DecoderLayer(
            Attention(
                hidden, heads, kv_heads, head_dim,
                qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
                qk_norm=qk_norm, scale=config.query_pre_attn_scalar**-0.5,
            ),
            GatedMLP(hidden, config.intermediate_size, config.hidden_activation),
            hidden,
            eps,
        )
        for _ in layer_types
    ]
    lm = DecoderLM(config, dtype)
    lm.model = DecoderBody(nn.Embedding(config.vocab_size, hidden), layers, RMSNorm(hidden, eps, offset=1.0))
    lm.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
    lm.embed_scale = float(torch.tensor(hidden**0.5, dtype=dtype))
    lm.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
    lm.layer_specs = [
        LayerAttentionSpec("sliding", config.sliding_window, t)
        if t == "sliding_attention"
        else LayerAttentionSpec("full", None, t)
        for t in layer_types
    ]
    lm.rotary = {}
    for t in sorted(set(layer_types)):
        inv_freq, scaling = rotary_from_transformers(config, t)
        lm.rotary[t] = RotaryTable(inv_freq, scaling, dtype)
    return lm
