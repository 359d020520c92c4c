"""Scheduler: waiting and running queues, admission, preemption, and each step's chunks.

Every step, running sequences get their tokens first (one per decode, then prefill chunks in
admission order), then waiting requests are admitted FCFS while the token budget,
`max_num_seqs` and free KV blocks allow. Blocks are taken on demand from the `KVCacheManager`;
when a running sequence needs one and none is free or evictable, the least protected running
sequence is preempted: its blocks are freed and it goes to the front of the waiting queue, to be
recomputed later (prompt + the tokens generated so far, as a prefill). Colocated requests are
preempted first (youngest first), imported (decode-only) requests last; a prefill-only request
is never preempted (a half-exported prefill cannot be replayed). A sequence alone in the engine
that still cannot get a block is handed back in `SchedulerOutput.out_of_kv`, to end with
"length".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from crossfill.engine.attention import ScheduledChunk
from crossfill.engine.kv_cache_manager import KVAllocation, KVCacheManager
from crossfill.engine.sequence import Mode, Sequence, Status
from crossfill.engine.types import NoKVCapacityError


@dataclass
class SchedulerOutput:
    decodes: dict[str, ScheduledChunk] = field(default_factory=dict)
    prefills: dict[str, ScheduledChunk] = field(default_factory=dict)
    out_of_kv: list[Sequence] = field(default_factory=list)  # end these with "length"
    preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in (*self.decodes.values(), *self.prefills.values()))

    def drop(self, seq: Sequence) -> None:
        self.decodes.pop(seq.request_id, None)
        self.prefills.pop(seq.request_id, None)


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.importing: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_out_of_kv = 0

    # --- queues ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_import(self, seq: Sequence, *, reuse_prefix: bool) -> KVAllocation:
        """Decode-only admission: the prompt's blocks now (minus held prefix), or NoKVCapacityError."""
        if len(self.running) + len(self.importing) >= self.max_num_seqs:
            raise NoKVCapacityError(f"decode engine is at max_num_seqs={self.max_num_seqs}")
        free = self.kv.free_blocks()
        alloc = self.kv.allocate_import(seq, reuse_prefix=reuse_prefix)
        if alloc is None:
            raise NoKVCapacityError(
                f"not enough free KV blocks for a {seq.prompt_len}-token prompt now "
                f"(free blocks per layer group: {free})"
            )
        seq.status = Status.IMPORTING
        self.importing[seq.request_id] = seq
        return alloc

    def start_decoding(self, seq: Sequence) -> None:
        """An import is committed: it joins the decode batch."""
        del self.importing[seq.request_id]
        seq.num_computed = seq.prompt_len
        self.kv.after_compute(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.importing.pop(seq.request_id, None)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.importing)

    # --- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq in self.running and self._secure(seq, seq.num_computed + 1, out) is not None:
                out.decodes[seq.request_id] = ScheduledChunk(seq, seq.num_computed, 1)
        for seq in [s for s in self.running if s.in_prefill]:
            budget = self.max_num_batched_tokens - out.num_tokens
            if budget <= 0:
                break
            if seq in self.running:
                self._schedule_prefill(seq, budget, out)
        if not out.preempted:  # what was just preempted must not come straight back
            self._admit(out)
        return out

    def _admit(self, out: SchedulerOutput) -> None:
        while self.waiting and len(self.running) + len(self.importing) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - out.num_tokens
            if budget <= 0:
                return
            seq = self.waiting[0]
            if self.kv.never_fits(seq.prefill_len) is not None:  # a recompute grown past the pool
                self.waiting.popleft()
                self._out_of_kv(seq, out)
                continue
            if self.kv.admit(seq, first_admission=seq.num_preemptions == 0) is None:
                return  # FCFS: later requests wait behind the head of the queue
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if not self._schedule_prefill(seq, budget, out):
                return

    def _schedule_prefill(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        end = self._secure(seq, seq.num_computed + min(seq.prefill_len - seq.num_computed, budget), out)
        if end is None:
            return False
        out.prefills[seq.request_id] = ScheduledChunk(seq, seq.num_computed, end - seq.num_computed)
        return True

    def _secure(self, seq: Sequence, end: int, out: SchedulerOutput) -> int | None:
        """Blocks for `seq` up to `end`, preempting others if needed; the end secured, or None.

        A prefill chunk with no one left to preempt shrinks to the blocks that are free.
        """
        while self.kv.append_slots(seq, end) is None:
            victim = self._victim()
            if victim is not None and victim is not seq:
                self._preempt(victim, out)
                continue
            shrunk = min(end, self.kv.reachable_end(seq))
            if shrunk > seq.num_computed and self.kv.append_slots(seq, shrunk) is not None:
                return shrunk
            if all(s is seq for s in self.running) and not self.importing:
                self._out_of_kv(seq, out)
            elif victim is seq:
                self._preempt(seq, out)
            return None  # a prefill-only request waits for blocks others hold
        return end

    def _victim(self) -> Sequence | None:
        """The least protected running sequence: colocated before imported, youngest first."""
        candidates = [(s.mode == Mode.COLOCATED, s.arrival, i, s) for i, s in enumerate(self.running)
                      if s.mode != Mode.PREFILL_ONLY]
        return max(candidates, key=lambda c: c[:3])[3] if candidates else None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        out.drop(seq)
        out.preempted += 1
        self.num_preemptions += 1
        self.kv.free(seq)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.prefill_len = len(seq.tokens)
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _out_of_kv(self, seq: Sequence, out: SchedulerOutput) -> None:
        out.drop(seq)
        self.num_out_of_kv += 1
        if seq in self.running:
            self.running.remove(seq)
        out.out_of_kv.append(seq)
