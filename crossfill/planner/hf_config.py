"""Read a Hugging Face ``config.json`` into a `ModelKV`.

Only the fields real configs use are read; a config that lacks what the layout needs raises a
`PlanError` naming the missing field. Layer kinds are decided, in order, by:

1. ``layer_types`` (Gemma 3, Qwen3-Next, recent transformers): ``full_attention``,
   ``sliding_attention``, ``linear_attention``, ``mamba``;
2. ``layers_block_type`` (``attention`` / ``mamba``; ``mlp`` and ``moe`` layers hold no KV);
3. ``hybrid_override_pattern`` (Nemotron-H: ``*`` attention, ``M`` Mamba-2, ``-``/``E`` MLP only);
4. ``attn_layer_period`` / ``attn_layer_offset`` (Jamba: attention where i % period == offset, else Mamba);
5. ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (Kimi Linear; 1-based layer numbers);
6. ``hybrid_layer_pattern`` (MiMo-V2-Flash; 1 = sliding window, 0 = global);
7. ``full_attention_interval`` (Qwen3-Next without ``layer_types``; every n-th layer is full);
8. ``sliding_window_pattern`` (older Gemma 3 configs; every n-th layer is global);
9. ``sliding_window`` with ``use_sliding_window`` not false (Mistral-style: every layer slides);
10. otherwise every layer is full attention.

Global layers are MLA when the config has ``kv_lora_rank`` (DeepSeek-V3, Kimi), else grouped-query
attention. Multimodal configs nest the language model under ``text_config``; its fields win.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crossfill.planner.errors import PlanError
from crossfill.planner.kv_accounting import LayerKind, LayerKV, ModelKV, SlidingKeep

_TYPE_NAMES: dict[str, LayerKind] = {
    "full_attention": "full",
    "attention": "full",
    "global": "full",
    "sliding_attention": "sliding",
    "sliding_window_attention": "sliding",
    "local": "sliding",
    "linear_attention": "linear",
    "mamba": "linear",
}


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    merged = {k: v for k, v in config.items() if k != "text_config"}
    text = config.get("text_config")
    if isinstance(text, Mapping):
        merged.update(text)
    return merged


def _int(cfg: Mapping[str, Any], key: str, *, positive: bool = True) -> int:
    value = cfg.get(key)
    if value is None:
        raise PlanError(f"config.json: missing {key!r}; expected a positive integer")
    if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0):
        raise PlanError(f"config.json: {key!r} is {value!r}; expected a positive integer")
    return value


def _opt_int(cfg: Mapping[str, Any], key: str) -> int | None:
    return _int(cfg, key) if cfg.get(key) is not None else None


_BLOCK_NAMES: dict[str, LayerKind | None] = {"attention": "full", "mamba": "linear", "mlp": None, "moe": None}
_PATTERN_CHARS: dict[str, LayerKind | None] = {"*": "full", "M": "linear", "-": None, "E": None}


def _layer_kinds(cfg: Mapping[str, Any], n: int) -> list[LayerKind | None]:
    """The KV kind of each decoder layer; None for layers that keep nothing (MLP-only blocks)."""
    if cfg.get("layers_block_type") is not None:
        blocks = cfg["layers_block_type"]
        if not isinstance(blocks, list) or len(blocks) != n or any(b not in _BLOCK_NAMES for b in blocks):
            raise PlanError(
                f"config.json: 'layers_block_type' must be {n} entries of {', '.join(_BLOCK_NAMES)}"
            )
        return [_BLOCK_NAMES[b] for b in blocks]
    if cfg.get("hybrid_override_pattern") is not None:
        pattern = cfg["hybrid_override_pattern"]
        if not isinstance(pattern, str) or len(pattern) != n or any(c not in _PATTERN_CHARS for c in pattern):
            raise PlanError(
                f"config.json: 'hybrid_override_pattern' must be {n} characters of '*' (attention), "
                "'M' (Mamba), '-' or 'E' (MLP)"
            )
        return [_PATTERN_CHARS[c] for c in pattern]
    if cfg.get("attn_layer_period") is not None:
        period = _int(cfg, "attn_layer_period")
        offset = cfg.get("attn_layer_offset", 0)
        return ["full" if i % period == offset else "linear" for i in range(n)]
    if cfg.get("layer_types") is not None:
        types = cfg["layer_types"]
        if not isinstance(types, list) or len(types) != n:
            raise PlanError(f"config.json: 'layer_types' must be a list of {n} entries (num_hidden_layers)")
        kinds = []
        for i, name in enumerate(types):
            if name not in _TYPE_NAMES:
                raise PlanError(
                    f"config.json: layer_types[{i}] is {name!r}; expected one of {', '.join(_TYPE_NAMES)}"
                )
            kinds.append(_TYPE_NAMES[name])
        return kinds
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, Mapping) and lac.get("kda_layers") is not None:
        kda = set(lac["kda_layers"])
        bad = [x for x in kda if not isinstance(x, int) or not 1 <= x <= n]
        if bad:
            raise PlanError(f"config.json: linear_attn_config.kda_layers has {bad}; expected numbers 1..{n}")
        return ["linear" if i + 1 in kda else "full" for i in range(n)]
    if cfg.get("hybrid_layer_pattern") is not None:
        pattern = cfg["hybrid_layer_pattern"]
        if not isinstance(pattern, list) or len(pattern) != n or any(p not in (0, 1) for p in pattern):
            raise PlanError(f"config.json: 'hybrid_layer_pattern' must be {n} entries of 0 (global) or 1 (sliding)")
        return ["sliding" if p == 1 else "full" for p in pattern]
    if cfg.get("full_attention_interval") is not None:
        every = _int(cfg, "full_attention_interval")
        return ["full" if (i + 1) % every == 0 else "linear" for i in range(n)]
    if cfg.get("sliding_window_pattern") is not None:
        every = _int(cfg, "sliding_window_pattern")
        return ["full" if (i + 1) % every == 0 else "sliding" for i in range(n)]
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False:
        return ["sliding"] * n
    return ["full"] * n


def _gqa_geometry(cfg: Mapping[str, Any], prefix: str = "") -> tuple[int, int, int]:
    """(kv_heads, k_head_dim, v_head_dim) of global (prefix "") or sliding (prefix "swa_") layers."""
    heads_key = f"{prefix}num_key_value_heads"
    if cfg.get(heads_key) is not None:
        kv_heads = _int(cfg, heads_key)
    elif prefix:
        return _gqa_geometry(cfg)
    elif cfg.get("num_attention_heads") is not None:
        kv_heads = _int(cfg, "num_attention_heads")  # no GQA field: multi-head attention
    else:
        raise PlanError(
            "config.json: missing 'num_key_value_heads' (and 'num_attention_heads'); "
            "expected the number of KV heads per layer"
        )
    if cfg.get(f"{prefix}head_dim") is not None:
        k_dim = _int(cfg, f"{prefix}head_dim")
    elif cfg.get("head_dim") is not None:
        k_dim = _int(cfg, "head_dim")
    elif cfg.get("attention_head_dim") is not None:  # Nemotron-H
        k_dim = _int(cfg, "attention_head_dim")
    elif cfg.get("hidden_size") is not None and cfg.get("num_attention_heads") is not None:
        hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
        if hidden % heads:
            raise PlanError(f"config.json: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        k_dim = hidden // heads
    else:
        raise PlanError(
            "config.json: missing 'head_dim' (or 'hidden_size' and 'num_attention_heads'); "
            "expected the per-head dimension"
        )
    v_dim = _opt_int(cfg, f"{prefix}v_head_dim") or (_opt_int(cfg, "v_head_dim") if prefix else None) or k_dim
    return kv_heads, k_dim, v_dim


def _linear_state_values(cfg: Mapping[str, Any]) -> int:
    """Elements of one linear/recurrent layer's per-request state (recurrent matrix + conv tail)."""
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, Mapping) and lac.get("num_heads") is not None:
        # Kimi Delta Attention: a head_dim x head_dim state per head; q, k, v short convolutions.
        heads, dim = _int(lac, "num_heads"), _int(lac, "head_dim")
        conv = _int(lac, "short_conv_kernel_size")
        return heads * dim * dim + 3 * heads * dim * (conv - 1)
    if cfg.get("linear_num_value_heads") is not None:
        # Gated DeltaNet (Qwen3-Next): a key_dim x value_dim state per value head; conv over q, k, v.
        v_heads, k_heads = _int(cfg, "linear_num_value_heads"), _int(cfg, "linear_num_key_heads")
        k_dim, v_dim = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        conv = _int(cfg, "linear_conv_kernel_dim")
        return v_heads * k_dim * v_dim + (2 * k_heads * k_dim + v_heads * v_dim) * (conv - 1)
    if cfg.get("mamba_num_heads") is not None:
        # Mamba-2 (Nemotron-H naming): heads x head_dim x d_state, conv over x, B and C.
        heads, head_dim, d_state = _int(cfg, "mamba_num_heads"), _int(cfg, "mamba_head_dim"), _int(cfg, "ssm_state_size")
        groups = _int(cfg, "n_groups") if cfg.get("n_groups") is not None else 1
        conv = _int(cfg, "conv_kernel") if cfg.get("conv_kernel") is not None else 4
        return heads * head_dim * d_state + (heads * head_dim + 2 * groups * d_state) * (conv - 1)
    if cfg.get("mamba_d_state") is not None:
        # Mamba-1 (Jamba naming): d_inner x d_state state plus the conv tail over d_inner channels.
        d_state = _int(cfg, "mamba_d_state")
        expand = _int(cfg, "mamba_expand") if cfg.get("mamba_expand") is not None else 2
        d_conv = _int(cfg, "mamba_d_conv") if cfg.get("mamba_d_conv") is not None else 4
        d_inner = expand * _int(cfg, "hidden_size")
        return d_inner * d_state + d_inner * (d_conv - 1)
    raise PlanError(
        "config.json: linear-attention layers need their state size: expected 'linear_attn_config' "
        "(num_heads, head_dim, short_conv_kernel_size), 'linear_num_value_heads' and friends, "
        "'mamba_num_heads' (Mamba-2) or 'mamba_d_state' (Mamba-1)"
    )


def model_from_hf_config(
    config: Mapping[str, Any], name: str, *, sliding_keep: SlidingKeep = "window", source: str = ""
) -> ModelKV:
    """Build the KV layout of a model from its Hugging Face config dictionary."""
    if not isinstance(config, Mapping):
        raise PlanError("config.json: expected a JSON object at the top level")
    cfg = _text_config(config)
    n = _int(cfg, "num_hidden_layers")
    kinds = _layer_kinds(cfg, n)
    is_mla = cfg.get("kv_lora_rank") is not None
    window = None
    if "sliding" in kinds:
        if cfg.get("sliding_window") is None and cfg.get("sliding_window_size") is None:
            raise PlanError("config.json: sliding layers but missing 'sliding_window'; expected the window in tokens")
        window = _int(cfg, "sliding_window" if cfg.get("sliding_window") is not None else "sliding_window_size")
    full_geo = None if is_mla else (_gqa_geometry(cfg) if "full" in kinds else None)
    swa_geo = _gqa_geometry(cfg, "swa_") if "sliding" in kinds else None
    latent = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim") if is_mla else 0
    state = _linear_state_values(cfg) if "linear" in kinds else 0

    layers = []
    for i, kind in enumerate(kinds):
        if kind is None:
            continue  # an MLP-only block: nothing to hand to decode
        if kind == "full" and is_mla:
            layers.append(LayerKV(i, "mla", latent_dim=latent))
        elif kind == "full":
            assert full_geo is not None
            layers.append(LayerKV(i, "full", *full_geo))
        elif kind == "sliding":
            assert swa_geo is not None
            layers.append(LayerKV(i, "sliding", *swa_geo, window=window))
        else:
            layers.append(LayerKV(i, "linear", state_values=state))
    return ModelKV(name=name, layers=tuple(layers), sliding_keep=sliding_keep, source=source)
