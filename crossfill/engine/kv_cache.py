"""The paged KV cache: block storage per layer group, sized by a memory budget.

Layers are grouped by what they keep: every full-attention layer in one group, sliding-window
layers (by window) in another. A group's layers share block tables, so one allocation serves all
of them, and a sliding group frees the blocks that fell out of its window independently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from crossfill.engine.block_pool import BlockPool
from crossfill.engine.types import LayerSpec


@dataclass
class LayerGroup:
    index: int
    kind: str  # "full" | "sliding"
    window: int | None
    layers: list[int]  # model layer indices in this group
    pool: BlockPool
    k: torch.Tensor  # [len(layers), num_blocks * block_size, kv_heads, head_dim]
    v: torch.Tensor
    local_index: dict[int, int] = field(default_factory=dict)  # model layer -> row in k/v

    def live_blocks_bound(self, total_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks a request of `total_tokens` ever holds at once in this group."""
        full = math.ceil(total_tokens / block_size)
        if self.kind != "sliding" or self.window is None:
            return full
        return min(full, math.ceil((self.window - 1 + chunk) / block_size) + 1)


class PagedKVCache:
    def __init__(
        self,
        layer_specs: list[LayerSpec],
        *,
        block_size: int,
        memory_bytes: int,
        max_num_seqs: int,
        max_chunk_tokens: int,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.layer_specs = layer_specs
        keys: dict[tuple[str, int | None], list[int]] = {}
        for spec in layer_specs:
            keys.setdefault((spec.kind, spec.window), []).append(spec.index)
        shapes = {(s.num_kv_heads, s.head_dim, s.dtype) for s in layer_specs}
        if len(shapes) != 1:
            raise ValueError(f"layers with different KV shapes are not supported: {shapes}")
        kv_heads, head_dim, dtype = shapes.pop()
        per_token_layer = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

        # Sliding groups need a bounded number of blocks per request; give them what
        # max_num_seqs requests can hold (x2 for prefix reuse) and the rest to full groups.
        budgets: dict[tuple[str, int | None], int] = {}
        remaining = memory_bytes
        for key, layers in keys.items():
            kind, window = key
            if kind == "sliding" and window is not None:
                per_seq = math.ceil((window - 1 + max_chunk_tokens) / block_size) + 1
                want = 2 * per_seq * max_num_seqs * block_size * per_token_layer * len(layers)
                budgets[key] = min(want, memory_bytes // 2)
                remaining -= budgets[key]
        full_layers = sum(len(v) for k, v in keys.items() if k not in budgets)
        for key, layers in keys.items():
            if key not in budgets:
                budgets[key] = remaining * len(layers) // max(full_layers, 1)

        self.groups: list[LayerGroup] = []
        self.layer_group: dict[int, LayerGroup] = {}
        for gi, (key, layers) in enumerate(sorted(keys.items(), key=lambda kv: kv[1][0])):
            kind, window = key
            block_bytes = block_size * per_token_layer * len(layers)
            num_blocks = budgets[key] // block_bytes
            if num_blocks < 2:
                raise ValueError(
                    f"kv memory budget of {memory_bytes / 2**20:.1f} MiB is too small for the "
                    f"{kind} layers: raise kv_memory_mb"
                )
            shape = (len(layers), num_blocks * block_size, kv_heads, head_dim)
            group = LayerGroup(
                gi, kind, window, layers, BlockPool(num_blocks),
                torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
            )
            group.local_index = {layer: i for i, layer in enumerate(layers)}
            self.groups.append(group)
            for layer in layers:
                self.layer_group[layer] = group

    @property
    def blocks_total(self) -> int:
        return sum(g.pool.num_blocks for g in self.groups)

    @property
    def blocks_used(self) -> int:
        return sum(g.pool.num_used for g in self.groups)

    @property
    def blocks_cached(self) -> int:
        return sum(g.pool.num_cached for g in self.groups)

    @property
    def bytes_total(self) -> int:
        return sum(g.k.numel() * g.k.element_size() * 2 for g in self.groups)
