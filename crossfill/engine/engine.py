"""LLMEngine: continuous batching with chunked prefill over a paged, prefix-cached KV cache.

One engine serves three roles: colocated (prefill then decode), prefill-only (hand out each
layer's KV as it is computed, plus the first token) and decode-only (admit a request whose KV
arrives from elsewhere, then decode). The engine is single-threaded; `AsyncEngine` drives it
from one thread and marshals calls onto it.

A step reads schedule -> run -> postprocess: the `Scheduler` decides the chunks (admitting,
allocating KV blocks on demand and preempting under memory pressure), the model runs them over
the paged cache, and sampled tokens are appended. Block tables belong to the `KVCacheManager`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from crossfill.engine.attention import ScheduledChunk, StepAttention, export_start
from crossfill.engine.block_pool import DEFAULT_BLOCK_SIZE
from crossfill.engine.detokenizer import IncrementalDetokenizer
from crossfill.engine.kv_cache import LayerGroup, PagedKVCache
from crossfill.engine.kv_cache_manager import KVCacheManager
from crossfill.engine.kv_events import KVEventBatch, KVEventLog
from crossfill.engine.model_loader import load_model
from crossfill.engine.sampler import sample_batch
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.scheduler import Scheduler, SchedulerOutput
from crossfill.engine.sequence import Mode, Sequence, Status
from crossfill.engine.types import (
    KVStats,
    LayerKVChunk,
    LayerSpec,
    PrefillOutput,
    RequestOutput,
)


@dataclass
class EngineConfig:
    kv_memory_mb: int = 512
    block_size: int = DEFAULT_BLOCK_SIZE
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
        self.kv = KVCacheManager(
            self.cache,
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            max_chunk_tokens=self.cfg.max_num_batched_tokens,
        )
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=self.cfg.max_num_seqs, max_num_batched_tokens=self.cfg.max_num_batched_tokens
        )
        # What the prefix cache holds, as hash events for the scheduler's KV index: the pool whose
        # blocks decide prefix hits (crossfill.engine.kv_events says what that leaves out).
        self.kv_event_log = KVEventLog()
        _prefix_deciding_group(self.cache.groups).pool.publish_events(self.kv_event_log)
        self.requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts, commits)
        self.last_step_ran = False  # whether the last step() ran a forward pass (AsyncEngine idles if not)

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

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self.scheduler.running)

    @property
    def importing(self) -> dict[str, Sequence]:
        return dict(self.scheduler.importing)

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
        export_from: int = 0,
    ) -> None:
        """Queue a request; prefill-only requests hand out KV through `kv_sink` per layer.

        `export_from`: prefill-only requests export each layer's tokens from
        max(export_start(group), export_from) — the decode side holds the rest.
        """
        mode = Mode.PREFILL_ONLY if prefill_only else Mode.COLOCATED
        seq = self._new_sequence(request_id, self.encode(prompt), params, namespace, mode)
        if not isinstance(export_from, int) or not 0 <= export_from < seq.prompt_len:
            raise ValueError(f"export_from={export_from!r} is invalid: must be in [0, {seq.prompt_len})")
        seq.sink = kv_sink
        seq.export_from = export_from
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def import_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        namespace: str = "",
        reuse_prefix: bool = False,
    ) -> Sequence:
        """Decode-only admission: allocate the prompt's blocks before any KV arrives.

        With `reuse_prefix`, leading full blocks already cached in `namespace` are taken instead
        (`seq.num_cached_tokens`); KV written below them is dropped. Raises NoKVCapacityError
        when the blocks are not free now (try later or another instance).
        """
        seq = self._new_sequence(request_id, list(prompt_token_ids), params, namespace, Mode.DECODE_ONLY)
        self.scheduler.add_import(seq, reuse_prefix=reuse_prefix)
        seq.written = torch.zeros(len(self.layer_specs), seq.prompt_len, dtype=torch.bool)
        self.requests[request_id] = seq
        return seq

    def write_kv(self, request_id: str, chunk: LayerKVChunk) -> None:
        """Store verified KV rows for an importing request; refuses anything out of place."""
        seq = self.scheduler.importing.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not importing KV (finished, aborted or unknown)")
        if not 0 <= chunk.layer < len(self.layer_specs):
            raise ValueError(f"KV chunk for layer {chunk.layer}: the model has {len(self.layer_specs)} layers")
        spec = self.layer_specs[chunk.layer]
        expected = (spec.num_kv_heads, spec.head_dim)
        for name, t in (("k", chunk.k), ("v", chunk.v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != expected or t.shape[0] != chunk.num_tokens:
                raise ValueError(
                    f"KV chunk {name} for layer {chunk.layer} has shape {tuple(t.shape)}, "
                    f"expected [tokens, {expected[0]}, {expected[1]}]"
                )
        first = export_start(self.cache.layer_group[chunk.layer], seq.prompt_len)
        if chunk.start < first or chunk.end > seq.prompt_len or chunk.num_tokens == 0:
            raise ValueError(
                f"KV chunk for layer {chunk.layer} covers tokens [{chunk.start}, {chunk.end}), "
                f"outside the expected [{first}, {seq.prompt_len})"
            )
        lo = max(chunk.start, seq.num_cached_tokens)  # rows of the held prefix stay as cached
        if lo >= chunk.end:
            return
        cut = lo - chunk.start
        self.kv.write(seq, chunk.layer, lo, chunk.k[cut:], chunk.v[cut:])
        seq.written[chunk.layer, lo : chunk.end] = True

    def commit_import(self, request_id: str, first_token_id: int) -> None:
        """All KV is in: the request joins the decode batch, starting from prefill's first token."""
        seq = self.scheduler.importing.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not importing KV (finished, aborted or unknown)")
        for spec in self.layer_specs:
            first = max(export_start(self.cache.layer_group[spec.index], seq.prompt_len), seq.num_cached_tokens)
            missing = (~seq.written[spec.index, first:]).nonzero()
            if missing.numel():
                lo = first + int(missing[0])
                raise ValueError(f"KV for layer {spec.index} is missing from token {lo}: cannot decode")
        if not 0 <= first_token_id < self.vocab_size:
            raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary")
        seq.written = None
        self.scheduler.start_decoding(seq)
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
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    def kv_stats(self) -> KVStats:
        return KVStats(
            self.cache.blocks_total,
            self.cache.blocks_used,
            self.cache.blocks_cached,
            self.scheduler.num_active,
            preemptions=self.scheduler.num_preemptions,
            out_of_kv_finishes=self.scheduler.num_out_of_kv,
        )

    def prefix_cache_hit_rate(self) -> float:
        return self.kv.hit_rate()

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def kv_events_since(self, seq: int, epoch: str | None = None) -> KVEventBatch:
        """Prefix-cache hashes stored/evicted from event `seq` on, or a full reset (thread-safe)."""
        return self.kv_event_log.since(seq, epoch)

    # --- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        for seq in plan.out_of_kv:
            self._finish_out_of_kv(seq, outputs)
        batch = [*plan.decodes.values(), *plan.prefills.values()]
        self.last_step_ran = bool(batch)
        if batch:
            logits, done = self._run(plan, batch)
            self._postprocess(batch, done, logits, outputs)
        return outputs

    def _run(self, plan: SchedulerOutput, batch: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        offset = 0
        for chunk in batch:
            chunk.offset = offset
            offset += chunk.num_tokens
        input_ids = torch.tensor([t for c in batch for t in c.seq.tokens[c.start : c.end]], dtype=torch.long)
        positions = torch.cat([torch.arange(c.start, c.end) for c in batch])
        backend = StepAttention(self.cache, list(plan.decodes.values()), list(plan.prefills.values()))
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, backend)
            done = [c for c in batch if c.end == len(c.seq.tokens)]
            logits = self.model.compute_logits(hidden[[c.offset + c.num_tokens - 1 for c in done]])
        return logits, done

    def _postprocess(
        self, batch: list[ScheduledChunk], done: list[ScheduledChunk], logits: torch.Tensor,
        outputs: list[RequestOutput],
    ) -> None:
        for chunk in batch:
            chunk.seq.num_computed = chunk.end
            self.kv.after_compute(chunk.seq)
        tokens = sample_batch(logits, [c.seq.params for c in done], [c.end for c in done])
        for i, (chunk, token) in enumerate(zip(done, tokens, strict=True)):
            seq = chunk.seq
            if seq.mode == Mode.PREFILL_ONLY:
                self._finish_prefill(seq, token, logits[i], outputs)
            else:
                self._append_token(seq, token, outputs)

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
        short = self.kv.never_fits(len(ids))
        if short is not None:
            group, need = short
            raise ValueError(
                f"a {len(ids)}-token prompt needs {need} KV blocks in the {group.kind} layers but the engine "
                f"has {group.pool.num_blocks}: raise kv_memory_mb or shorten the prompt"
            )
        stop = [] if mode == Mode.PREFILL_ONLY else params.stop
        detok = IncrementalDetokenizer(self.tokenizer, ids, stop)
        seq = Sequence(request_id, ids, params, namespace, mode, detok, len(self.cache.groups))
        self.kv.hash_blocks(seq, len(ids))
        return seq

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

    def _finish_out_of_kv(self, seq: Sequence, outputs: list[RequestOutput]) -> None:
        """Alone and still no KV block to grow into: end as if max_tokens were reached."""
        text = seq.detok.take(final=True)
        self._finish(seq, "length")
        outputs.append(self._output(seq, [], text))

    def _finish_prefill(self, seq: Sequence, token: int, logits: torch.Tensor, outputs) -> None:
        result = PrefillOutput(seq.request_id, list(seq.prompt_ids), token, logits.clone(), seq.num_cached_tokens)
        self._finish(seq, "prefill")
        out = self._output(seq, [], "")
        out.prefill = result
        outputs.append(out)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.FINISHED:
            return
        self.scheduler.finish(seq)
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


def _prefix_deciding_group(groups: list[LayerGroup]) -> LayerGroup:
    """The first full-attention group: a prefix hit of k blocks needs it to hold blocks 0..k."""
    for group in groups:
        if group.kind != "sliding" or group.window is None:
            return group
    return groups[0]  # sliding layers only: the index under-reports (see crossfill.engine.kv_events)
