"""Per-request state inside the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from crossfill.engine.block_pool import NULL_BLOCK
from crossfill.engine.detokenizer import IncrementalDetokenizer
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import LayerKVChunk


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission (holds no blocks)
    RUNNING = "running"  # prefilling or decoding
    IMPORTING = "importing"  # decode-only: blocks allocated, KV arriving from outside
    FINISHED = "finished"


class Mode(enum.Enum):
    COLOCATED = "colocated"
    PREFILL_ONLY = "prefill_only"
    DECODE_ONLY = "decode_only"


@dataclass(eq=False)  # identity: a sequence is one request's state
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str
    mode: Mode
    detok: IncrementalDetokenizer
    num_groups: int
    sink: Callable[[LayerKVChunk], None] | None = None
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # leading tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (first admission)
    prefill_len: int = 0  # tokens to prefill: the prompt, or prompt + generated after a preemption
    export_from: int = 0  # prefill-only: first token whose KV the decode side lacks
    num_preemptions: int = 0
    tables: list[list[int]] = field(default_factory=list)  # block table per layer group
    registered: list[int] = field(default_factory=list)  # leading blocks published to the prefix cache
    hashes: list[bytes] = field(default_factory=list)  # chain hash of each full block of `tokens`
    written: torch.Tensor | None = None  # decode-only: [layers, prompt_len] bool, KV rows received
    arrival: float = field(default_factory=time.monotonic)
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.tables = [[] for _ in range(self.num_groups)]
        self.prefill_len = len(self.prompt_ids)
        self.registered = [0] * self.num_groups

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len

    def live_blocks(self) -> list[tuple[int, int]]:
        """(group, block) of every block this sequence references."""
        return [(g, b) for g, table in enumerate(self.tables) for b in table if b != NULL_BLOCK]
