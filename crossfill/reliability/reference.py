"""The expected answer of every request the harness can send: greedy output of the offline engine.

Every serving path (local or remote prefill, any transport or codec, retries, fallbacks,
preemption) is token-exact with the colocated engine in this project, so a completed greedy
answer that differs from `LLM(...).generate` in fp32 is a wrong output, not noise. Computed once
in the harness process before the cluster starts; the engine is released afterwards.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from crossfill.reliability.workload import Mix, Prompt, PromptPool, chat_prompt


@dataclass(frozen=True)
class Expected:
    token_ids: tuple[int, ...]
    text: str


References = dict[tuple[str, int], Expected]  # (prompt key, max_tokens) -> expected output


def load_tokenizer(model: str) -> Any:
    from crossfill.models import load_tokenizer as load
    from crossfill.models import resolve_model

    return load(resolve_model(model, pull=False))


def compute_references(model: str, mixes: list[Mix], pool: PromptPool) -> References:
    """Greedy outputs (ignore_eos, as the specs ask) of every shape the mixes send; fills each
    mix's `chat_turns` with the turn prompts, whose assistant messages are the reference answers."""
    from crossfill.engine.llm import LLM
    from crossfill.engine.sampling import SamplingParams

    llm = LLM(model, kv_memory_mb=64, max_num_seqs=16)
    tok = llm.tokenizer
    refs: References = {}
    by_length: dict[int, set[Prompt]] = defaultdict(set)
    for mix in mixes:
        for prompt, max_tokens in mix.shapes():
            by_length[max_tokens].add(prompt)
    for max_tokens, prompts in by_length.items():
        ordered = sorted(prompts, key=lambda p: p.key)
        outs = llm.generate([tok.encode(p.text) for p in ordered],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        for p, out in zip(ordered, outs, strict=True):
            refs[(p.key, max_tokens)] = Expected(tuple(out.token_ids), out.text)
    chat_lengths = {m for mix in mixes if (m := mix.chat_max_tokens()) is not None}
    for max_tokens in chat_lengths:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        turns_by_chat = {}
        for i, user_turns in enumerate(pool.chats):
            history: list[tuple[str, str]] = []
            turns = []
            for user in user_turns:
                history.append(("user", user))
                prompt = chat_prompt(i, list(history))
                out = llm.chat([{"role": r, "content": c} for r, c in history], params)
                refs[(prompt.key, max_tokens)] = Expected(tuple(out.token_ids), out.text)
                history.append(("assistant", out.text))
                turns.append(prompt)
            turns_by_chat[i] = turns
        for mix in mixes:
            if mix.chat_max_tokens() == max_tokens:
                mix.chat_turns = turns_by_chat
    del llm
    gc.collect()
    return refs
