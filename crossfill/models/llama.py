"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over crossfill's paged KV.

The modules mirror Hugging Face parameter names (`model.layers.N.self_attn.q_proj.weight`, ...) so a
transformers state dict loads unchanged, and attention is delegated to an `AttentionBackend`
owned by the engine: the model never sees the KV cache layout, which is what lets the same
forward pass run colocated, prefill-only (exporting KV per layer) or decode-only (on imported KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers.activations import ACT2FN


class AttentionBackend(Protocol):
    """Stores this step's K/V in the paged cache and computes attention for the flat token batch."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:  # q [T, heads, dim], k/v [T, kv_heads, dim] -> [T, heads, dim]
        ...


@dataclass(frozen=True)
class LayerAttentionSpec:
    """Per-layer attention facts the engine needs to size and manage the cache."""

    kind: str  # "full" | "sliding"
    window: int | None
    rope_key: str  # which rotary table this layer uses


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; `offset=1.0` gives Gemma's (1 + weight) scaling."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class RotaryTable:
    """cos/sin for absolute positions, from transformers' own RoPE initialisation (all rope types)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq.float()
        self.scaling = float(attention_scaling)
        self.dtype = dtype
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)

    def _grow(self, n: int) -> None:
        size = max(n, 2 * self._cos.shape[0], 256)
        freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * self.scaling).to(self.dtype)
        self._sin = (emb.sin() * self.scaling).to(self.dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self._cos.shape[0]:
            self._grow(top)
        return self._cos[positions], self._sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim]; cos/sin [T, dim] (rotate-half convention, as transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: RMSNormFactory | None,
        scale: float,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None
        self.scale = scale

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        layer: int,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = backend(layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(t, self.heads * self.head_dim))


class RMSNormFactory(Protocol):
    def __call__(self, dim: int) -> RMSNorm: ...


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, norm: RMSNormFactory, hidden: int) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = norm(hidden)
        self.post_attention_layernorm = norm(hidden)

    def forward(self, x, cos, sin, backend: AttentionBackend, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The `model.` part of a causal LM: embeddings, layers, final norm."""

    def __init__(self, embed: nn.Embedding, layers: list[nn.Module], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderLM(nn.Module):
    """A decoder-only causal LM running on a flat batch of tokens from many sequences."""

    def __init__(self, config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.layer_specs: list[LayerAttentionSpec] = []
        self.rotary: dict[str, RotaryTable] = {}
        self.embed_scale: float = 1.0
        self.final_logit_softcapping: float | None = None
        self.model: DecoderBody
        self.lm_head: nn.Linear

    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        tables = {key: table.lookup(positions) for key, table in self.rotary.items()}
        for i, layer in enumerate(self.model.layers):
            cos, sin = tables[self.layer_specs[i].rope_key]
            x = layer(x, cos, sin, backend, i)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict; tied embeddings may omit lm_head."""
        state = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if "lm_head.weight" not in state and getattr(self.config, "tie_word_embeddings", False):
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the {self.config.model_type} architecture: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


def rotary_from_transformers(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling exactly as transformers computes them (default, llama3, yarn...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    fn = ROPE_INIT_FUNCTIONS[rope_type]
    if layer_type is not None:
        return fn(config, None, layer_type=layer_type)
    return fn(config, None)


def _layer_kinds(config) -> list[tuple[str, int | None]]:
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types:
        return [("sliding", window) if t == "sliding_attention" else ("full", None) for t in layer_types]
    if config.model_type == "mistral" and window:
        return [("sliding", window)] * n
    return [("full", None)] * n


def build_llama(config, dtype: torch.dtype = torch.float32) -> DecoderLM:
    """Llama/Mistral/Qwen2/Qwen3 from a transformers config."""
    model_type = config.model_type
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    eps = config.rms_norm_eps
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = True if model_type == "qwen2" else attention_bias
    o_bias = False if model_type == "qwen2" else attention_bias
    mlp_bias = bool(getattr(config, "mlp_bias", False))

    def norm(dim: int) -> RMSNorm:
        return RMSNorm(dim, eps)

    lm = DecoderLM(config, dtype)
    layers = [
        LlamaDecoderLayer(
            Attention(
                hidden, heads, kv_heads, head_dim,
                qkv_bias=qkv_bias, o_bias=o_bias,
                qk_norm=norm if model_type == "qwen3" else None,
                scale=head_dim**-0.5,
            ),
            GatedMLP(hidden, config.intermediate_size, config.hidden_act, mlp_bias),
            norm,
            hidden,
        )
        for _ in range(config.num_hidden_layers)
    ]
    lm.model = DecoderBody(nn.Embedding(config.vocab_size, hidden), layers, norm(hidden))
    lm.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
    lm.layer_specs = [LayerAttentionSpec(kind, window, "default") for kind, window in _layer_kinds(config)]
    inv_freq, scaling = rotary_from_transformers(config)
    lm.rotary = {"default": RotaryTable(inv_freq, scaling, dtype)}
    return lm
