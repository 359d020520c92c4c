"""Attention over the paged KV cache for one engine step (a flat batch of decode and prefill tokens).

Index tensors (where each token's K/V goes, which cache rows each query reads, masks) are built
once per step and layer group, then reused by every layer of the group. Decode tokens run as
one batched SDPA call over gathered, padded keys; each prefill chunk runs as its own call.
Prefill-only requests get their freshly written K/V handed out per layer, right here, so
the transfer to the decode instance overlaps the remaining layers of prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from crossfill.engine.kv_cache import LayerGroup, PagedKVCache
from crossfill.engine.sequence import Sequence
from crossfill.engine.types import LayerKVChunk


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    offset: int = 0  # row of its first token in the flat batch

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def slot_indices(table: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def key_start(group: LayerGroup, query_pos: int) -> int:
    """First key position a query at `query_pos` attends to in this group."""
    if group.kind == "sliding" and group.window is not None:
        return max(0, query_pos - group.window + 1)
    return 0


def export_start(group: LayerGroup, prompt_len: int) -> int:
    """First prompt position whose KV the decode side needs (sliding layers: the last window-1)."""
    if group.kind == "sliding" and group.window is not None:
        return max(0, prompt_len - (group.window - 1))
    return 0


@dataclass
class _GroupPlan:
    write_slots: torch.Tensor  # [T]
    decode_gather: torch.Tensor | None  # [B, Lmax]
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] or None when no padding is needed
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (row_lo, row_hi, gather, mask)


class StepAttention:
    """The `AttentionBackend` the model calls for each layer during one step."""

    def __init__(
        self, cache: PagedKVCache, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
    ) -> None:
        self.cache = cache
        self.num_decodes = len(decodes)
        self.prefills = prefills
        self.exports = [c for c in prefills if c.seq.sink is not None]
        bs = cache.block_size
        self.plans: dict[int, _GroupPlan] = {}
        for group in cache.groups:
            g = group.index
            slots = [
                slot_indices(c.seq.tables[g], torch.arange(c.start, c.end), bs) for c in decodes + prefills
            ]
            decode_gather = decode_mask = None
            if decodes:
                rows = [
                    slot_indices(c.seq.tables[g], torch.arange(key_start(group, c.start), c.end), bs)
                    for c in decodes
                ]
                longest = max(len(r) for r in rows)
                decode_gather = torch.zeros(len(rows), longest, dtype=torch.long)
                if any(len(r) != longest for r in rows):
                    decode_mask = torch.zeros(len(rows), 1, 1, longest, dtype=torch.bool)
                for i, r in enumerate(rows):
                    decode_gather[i, : len(r)] = r
                    if decode_mask is not None:
                        decode_mask[i, 0, 0, : len(r)] = True
            plans = []
            for c in prefills:
                lo = key_start(group, c.start)
                key_pos = torch.arange(lo, c.end)
                gather = slot_indices(c.seq.tables[g], key_pos, bs)
                mask: torch.Tensor | None = None
                if lo != c.start or group.kind == "sliding":
                    q_pos = torch.arange(c.start, c.end)[:, None]
                    mask = key_pos[None, :] <= q_pos
                    if group.kind == "sliding" and group.window is not None:
                        mask &= key_pos[None, :] > q_pos - group.window
                plans.append((c.offset, c.offset + c.num_tokens, gather, mask))
            self.plans[g] = _GroupPlan(torch.cat(slots), decode_gather, decode_mask, plans)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        group = self.cache.layer_group[layer]
        row = group.local_index[layer]
        kc, vc = group.k[row], group.v[row]
        plan = self.plans[group.index]
        kc.index_copy_(0, plan.write_slots, k)
        vc.index_copy_(0, plan.write_slots, v)
        if self.exports:
            self._export(layer, group, kc, vc, k, v)

        out = torch.empty_like(q)
        b = self.num_decodes
        if b:
            gk = kc[plan.decode_gather].transpose(1, 2)  # [B, kv_heads, L, dim]
            gv = vc[plan.decode_gather].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:b, :, None, :], gk, gv, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
            )
            out[:b] = o[:, :, 0, :]
        for lo, hi, gather, mask in plan.prefills:
            gk = kc[gather].transpose(0, 1)[None]
            gv = vc[gather].transpose(0, 1)[None]
            qq = q[lo:hi].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qq, gk, gv, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            out[lo:hi] = o[0].transpose(0, 1)
        return out

    def _export(
        self,
        layer: int,
        group: LayerGroup,
        kc: torch.Tensor,
        vc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        bs = self.cache.block_size
        for c in self.exports:
            seq = c.seq
            first = max(export_start(group, seq.prompt_len), seq.export_from)
            if c.start > first and c.start == seq.num_cached_tokens and seq.num_cached_tokens:
                # KV of prefix-cache hits was never computed here: hand it out from the cache.
                pos = torch.arange(first, c.start)
                slots = slot_indices(seq.tables[group.index], pos, bs)
                seq.sink(LayerKVChunk(layer, first, kc[slots].clone(), vc[slots].clone()))
            lo = max(c.start, first)
            if lo < c.end:
                a, b = c.offset + lo - c.start, c.offset + c.num_tokens
                seq.sink(LayerKVChunk(layer, lo, k[a:b].clone(), v[a:b].clone()))

