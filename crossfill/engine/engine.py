"""LLMEngine: continuous batching with chunked prefill over a paged, prefix-cached KV cache.

One engine serves three roles: colocated (prefill then decode), prefill-only (hand out each
layer's KV as it is computed, plus the first token) and decode-only (admit a request whose KV
arrives from elsewhere, then decode). The engine is single-threaded; `AsyncEngine` drives it
from one thread and marshals calls onto it.

Admission control promises each request the most blocks it can ever hold at once, so a step
never runs out of KV memory: requests wait in the queue (or are refused when they could never
fit) instead of failing mid-generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from crossfill.engine.attention import (
    ScheduledChunk,
    StepAttention,
    export_start,
    release_out_of_window,
    slot_indices,
)
from crossfill.engine.block_pool import NULL_BLOCK, chain_hash
from crossfill.engine.detokenizer import IncrementalDetokenizer
from crossfill.engine.kv_cache import PagedKVCache
from crossfill.engine.model_loader import load_model
from crossfill.engine.sampler import sample_batch
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.sequence import Mode, Sequence, Status
from crossfill.engine.types import (
    KVStats,
    LayerKVChunk,
    LayerSpec,
    NoKVCapacityError,
    PrefillOutput,
    RequestOutput,
)


@dataclass
class EngineConfig:
    kv_memory_mb: int = 512
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024  # per step: decode tokens + prefill chunk tokens
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    dtype: torch.dtype = torch.float32
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_memory_mb", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name}={value!r} is invalid: must be an integer > 0")


class LLMEngine:
    def __init__(
        self,
        config,  # transformers PretrainedConfig
        state_dict: dict[str, torch.Tensor],
        tokenizer,
        *,
        eos_token_ids: list[int] | None = None,
        fingerprint: str = "",
        model_name: str = "",
        engine_config: EngineConfig | None = None,
    ) -> None:
        self.cfg = engine_config or EngineConfig()
        if self.cfg.num_threads:
            torch.set_num_threads(self.cfg.num_threads)
        self.model = load_model(config, state_dict, self.cfg.dtype)
        self.hf_config = config
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.model_name = model_name
        self.eos_token_ids = set(eos_token_ids or [])
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        limit = getattr(text_config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(self.cfg.max_model_len or limit, limit)
        self.vocab_size = text_config.vocab_size
        attn0 = self.model.model.layers[0].self_attn
        self.layer_specs = [
            LayerSpec(i, s.kind, s.window, attn0.kv_heads, attn0.head_dim, self.cfg.dtype)
            for i, s in enumerate(self.model.layer_specs)
        ]
        self.cache = PagedKVCache(
            self.layer_specs,
            block_size=self.cfg.block_size,
            memory_bytes=self.cfg.kv_memory_mb * 2**20,
            max_num_seqs=self.cfg.max_num_seqs,
            max_chunk_tokens=self.cfg.max_num_batched_tokens,
        )
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.importing: dict[str, Sequence] = {}
        self.requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts, commits)

    # --- public API -------------------------------------------------------------------------
    @classmethod
    def from_model(cls, name_or_path: str, engine_config: EngineConfig | None = None) -> LLMEngine:
        from crossfill import models

        files = models.resolve_model(name_or_path)
        return cls(
            models.load_config(files),
            models.load_state_dict(files),
            models.load_tokenizer(files),
            eos_token_ids=models.eos_token_ids(files),
            fingerprint=files.fingerprint,
            model_name=files.name,
            engine_config=engine_config,
        )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        namespace: str = "",
        prefill_only: bool = False,
        kv_sink: Callable[[LayerKVChunk], None] | None = None,
    ) -> None:
        """Queue a request; prefill-only requests hand out KV through `kv_sink` per layer."""
        mode = Mode.PREFILL_ONLY if prefill_only else Mode.COLOCATED
        seq = self._new_sequence(request_id, self.encode(prompt), params, namespace, mode)
        seq.sink = kv_sink
        self.requests[request_id] = seq
        self.waiting.append(seq)

    def import_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, namespace: str = ""
    ) -> Sequence:
        """Decode-only admission: promise and allocate the request's blocks before any KV arrives.

        Raises NoKVCapacityError when the blocks are not free now (try later or another instance).
        """
        seq = self._new_sequence(request_id, list(prompt_token_ids), params, namespace, Mode.DECODE_ONLY)
        if len(self.running) + len(self.importing) >= self.cfg.max_num_seqs:
            raise NoKVCapacityError(f"decode engine is at max_num_seqs={self.cfg.max_num_seqs}")
        if not self._reserve(seq, prefix_hits=False):
            raise NoKVCapacityError(
                f"not enough free KV blocks for {len(seq.tokens)} prompt + {params.max_tokens} new tokens now"
            )
        n = seq.prompt_len
        for group in self.cache.groups:
            first = export_start(group, n) // self.cfg.block_size
            last = (n - 1) // self.cfg.block_size
            table = seq.tables[group.index]
            table.extend([NULL_BLOCK] * first)
            table.extend(group.pool.allocate() for _ in range(first, last + 1))
        seq.written = torch.zeros(len(self.layer_specs), n, dtype=torch.bool)
        seq.status = Status.IMPORTING
        self.requests[request_id] = seq
        self.importing[request_id] = seq
        return seq

    def write_kv(self, request_id: str, chunk: LayerKVChunk) -> None:
        """Store verified KV rows for an importing request; refuses anything out of place."""
        seq = self.importing.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not importing KV (finished, aborted or unknown)")
        if not 0 <= chunk.layer < len(self.layer_specs):
            raise ValueError(f"KV chunk for layer {chunk.layer}: the model has {len(self.layer_specs)} layers")
        spec = self.layer_specs[chunk.layer]
        group = self.cache.layer_group[chunk.layer]
        expected = (spec.num_kv_heads, spec.head_dim)
        for name, t in (("k", chunk.k), ("v", chunk.v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != expected or t.shape[0] != chunk.num_tokens:
                raise ValueError(
                    f"KV chunk {name} for layer {chunk.layer} has shape {tuple(t.shape)}, "
                    f"expected [tokens, {expected[0]}, {expected[1]}]"
                )
        first = export_start(group, seq.prompt_len)
        if chunk.start < first or chunk.end > seq.prompt_len or chunk.num_tokens == 0:
            raise ValueError(
                f"KV chunk for layer {chunk.layer} covers tokens [{chunk.start}, {chunk.end}), "
                f"outside the expected [{first}, {seq.prompt_len})"
            )
        slots = slot_indices(seq.tables[group.index], torch.arange(chunk.start, chunk.end), self.cfg.block_size)
        row = group.local_index[chunk.layer]
        group.k[row].index_copy_(0, slots, chunk.k.to(self.cfg.dtype))
        group.v[row].index_copy_(0, slots, chunk.v.to(self.cfg.dtype))
        seq.written[chunk.layer, chunk.start : chunk.end] = True

    def commit_import(self, request_id: str, first_token_id: int) -> None:
        """All KV is in: the request joins the decode batch, starting from prefill's first token."""
        seq = self.importing.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not importing KV (finished, aborted or unknown)")
        for spec in self.layer_specs:
            first = export_start(self.cache.layer_group[spec.index], seq.prompt_len)
            missing = (~seq.written[spec.index, first:]).nonzero()
            if missing.numel():
                lo = first + int(missing[0])
                raise ValueError(f"KV for layer {spec.index} is missing from token {lo}: cannot decode")
        if not 0 <= first_token_id < self.vocab_size:
            raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary")
        del self.importing[request_id]
        seq.written = None
        seq.num_computed = seq.prompt_len
        self._publish_blocks(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._append_token(seq, first_token_id, self._pending)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        seq = self.requests.get(request_id)
        if seq is None or seq.status == Status.FINISHED:
            return False
        self._finish(seq, reason)
        self._pending.append(self._output(seq, [], ""))
        return True

    def take_pending(self) -> list[RequestOutput]:
        """Outputs produced between steps (a committed import's first token, aborts), without a step."""
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def kv_stats(self) -> KVStats:
        return KVStats(
            self.cache.blocks_total,
            self.cache.blocks_used,
            self.cache.blocks_cached,
            len(self.running) + len(self.waiting) + len(self.importing),
        )

    def prefix_cache_hit_rate(self) -> float:
        queries = sum(g.pool.queries for g in self.cache.groups[:1])
        return sum(g.pool.hits for g in self.cache.groups[:1]) / queries if queries else 0.0

    # --- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        decodes, prefills = self._schedule()
        if not decodes and not prefills:
            return outputs
        batch = decodes + prefills
        offset = 0
        for chunk in batch:
            chunk.offset = offset
            offset += chunk.num_tokens
            self._allocate(chunk)
        input_ids = torch.tensor(
            [t for c in batch for t in c.seq.tokens[c.start : c.end]], dtype=torch.long
        )
        positions = torch.cat([torch.arange(c.start, c.end) for c in batch])
        backend = StepAttention(self.cache, decodes, prefills)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, backend)
            done = [c for c in batch if c.end == len(c.seq.tokens)]
            logits = self.model.compute_logits(hidden[[c.offset + c.num_tokens - 1 for c in done]])
        for chunk in batch:
            seq = chunk.seq
            seq.num_computed = chunk.end
            self._publish_blocks(seq)
            for group in self.cache.groups:
                release_out_of_window(group, seq, self.cfg.block_size)
        tokens = sample_batch(logits, [c.seq.params for c in done], [c.end for c in done])
        for i, (chunk, token) in enumerate(zip(done, tokens, strict=True)):
            seq = chunk.seq
            if seq.mode == Mode.PREFILL_ONLY:
                self._finish_prefill(seq, token, logits[i], outputs)
            else:
                self._append_token(seq, token, outputs)
        return outputs

    # --- internals ----------------------------------------------------------------------------
    def _new_sequence(
        self, request_id: str, ids: list[int], params: SamplingParams, namespace: str, mode: Mode
    ) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a crossfill SamplingParams")
        params.validate()
        if request_id in self.requests and self.requests[request_id].status != Status.FINISHED:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        new_tokens = 0 if mode == Mode.PREFILL_ONLY else params.max_tokens
        if len(ids) + new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {new_tokens} exceeds the model's context of "
                f"{self.max_model_len} tokens: shorten the prompt or lower max_tokens"
            )
        stop = [] if mode == Mode.PREFILL_ONLY else params.stop
        detok = IncrementalDetokenizer(self.tokenizer, ids, stop)
        seq = Sequence(request_id, ids, params, namespace, mode, detok, len(self.cache.groups))
        self._check_fits_ever(seq)
        if self.cfg.enable_prefix_caching:
            self._hash_blocks(seq, len(ids))
        return seq

    def _need(self, seq: Sequence) -> list[int]:
        total = seq.prompt_len + (0 if seq.mode == Mode.PREFILL_ONLY else seq.params.max_tokens)
        return [
            g.live_blocks_bound(total, self.cfg.block_size, self.cfg.max_num_batched_tokens)
            for g in self.cache.groups
        ]

    def _check_fits_ever(self, seq: Sequence) -> None:
        for group, need in zip(self.cache.groups, self._need(seq), strict=True):
            if need > group.pool.num_blocks:
                raise ValueError(
                    f"request needs {need} KV blocks in the {group.kind} layers but the engine has "
                    f"{group.pool.num_blocks}: raise kv_memory_mb or lower max_tokens / the prompt length"
                )

    def _reserve(self, seq: Sequence, prefix_hits: bool) -> bool:
        need = self._need(seq)
        for group, n in zip(self.cache.groups, need, strict=True):
            if group.committed + n > group.pool.num_blocks:
                return False
        for group, n in zip(self.cache.groups, need, strict=True):
            group.committed += n
            seq.reserved[group.index] = n
        if prefix_hits and self.cfg.enable_prefix_caching:
            self._take_prefix_hits(seq)
        return True

    def _hash_blocks(self, seq: Sequence, upto: int) -> None:
        bs = self.cfg.block_size
        while (len(seq.hashes) + 1) * bs <= upto:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else b""
            seq.hashes.append(chain_hash(parent, seq.namespace, seq.tokens[i * bs : (i + 1) * bs]))

    def _take_prefix_hits(self, seq: Sequence) -> None:
        bs = self.cfg.block_size
        groups = self.cache.groups
        first_pool = groups[0].pool
        first_pool.queries += 1
        best = 0
        # Leave at least one prompt token to compute: its logits give the first output token.
        for k in range(min(len(seq.hashes), (seq.prompt_len - 1) // bs), 0, -1):
            if all(self._group_has_prefix(g, seq, k) for g in groups):
                best = k
                break
        if not best:
            return
        first_pool.hits += 1
        for group in groups:
            lo = self._group_first_block(group, best)
            table = seq.tables[group.index]
            table.extend([NULL_BLOCK] * lo)
            for i in range(lo, best):
                block = group.pool.lookup(seq.hashes[i])
                assert block is not None
                table.append(block)
            seq.registered[group.index] = best
        seq.num_computed = seq.num_cached_tokens = best * bs

    def _group_first_block(self, group, num_blocks: int) -> int:
        if group.kind == "sliding" and group.window is not None:
            return max(0, num_blocks * self.cfg.block_size - group.window + 1) // self.cfg.block_size
        return 0

    def _group_has_prefix(self, group, seq: Sequence, k: int) -> bool:
        lo = self._group_first_block(group, k)
        return all(group.pool.contains(seq.hashes[i]) for i in range(lo, k))

    def _schedule(self) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        budget = self.cfg.max_num_batched_tokens
        decodes = [ScheduledChunk(s, s.num_computed, 1) for s in self.running if not s.in_prefill]
        budget -= len(decodes)
        prefills = []
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                n = min(seq.prompt_len - seq.num_computed, budget)
                prefills.append(ScheduledChunk(seq, seq.num_computed, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) + len(self.importing) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._reserve(seq, prefix_hits=True):
                break  # FCFS: later requests wait behind the head of the queue
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.prompt_len - seq.num_computed, budget)
            prefills.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return decodes, prefills

    def _allocate(self, chunk: ScheduledChunk) -> None:
        bs = self.cfg.block_size
        seq = chunk.seq
        for group in self.cache.groups:
            table = seq.tables[group.index]
            while len(table) * bs < chunk.end:
                table.append(group.pool.allocate())

    def _publish_blocks(self, seq: Sequence) -> None:
        """Make fully computed blocks findable by later requests with the same prefix."""
        if not self.cfg.enable_prefix_caching:
            return
        full = seq.num_computed // self.cfg.block_size
        self._hash_blocks(seq, full * self.cfg.block_size)
        for group in self.cache.groups:
            table = seq.tables[group.index]
            for i in range(seq.registered[group.index], min(full, len(table))):
                if table[i] != NULL_BLOCK:
                    group.pool.register(table[i], seq.hashes[i])
            seq.registered[group.index] = max(seq.registered[group.index], full)

    def _append_token(self, seq: Sequence, token: int, outputs: list[RequestOutput]) -> None:
        seq.tokens.append(token)
        params = seq.params
        seq.detok.add(token)
        reason = None
        cut = None
        if not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason = "stop"
        else:
            cut = seq.detok.find_stop()
            if cut is not None:
                reason = "stop"
            elif seq.num_generated >= params.max_tokens:
                reason = "length"
        text = seq.detok.take(final=reason is not None, cut=cut)
        if reason is not None:
            self._finish(seq, reason)
        outputs.append(self._output(seq, [token], text))

    def _finish_prefill(self, seq: Sequence, token: int, logits: torch.Tensor, outputs) -> None:
        result = PrefillOutput(seq.request_id, list(seq.prompt_ids), token, logits.clone(), seq.num_cached_tokens)
        self._finish(seq, "prefill")
        out = self._output(seq, [], "")
        out.prefill = result
        outputs.append(out)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.FINISHED:
            return
        for g, block in seq.live_blocks():
            self.cache.groups[g].pool.release(block)
        for group in self.cache.groups:
            group.committed -= seq.reserved[group.index]
            seq.reserved[group.index] = 0
            seq.tables[group.index] = []
        for collection in (self.running, self.waiting):
            if seq in collection:
                collection.remove(seq)
        self.importing.pop(seq.request_id, None)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence, new_ids: list[int], text: str) -> RequestOutput:
        finished = seq.status == Status.FINISHED
        return RequestOutput(
            seq.request_id,
            new_ids,
            text,
            finished,
            seq.finish_reason if finished else None,
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.num_generated,
            num_cached_tokens=seq.num_cached_tokens,
        )
