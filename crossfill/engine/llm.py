"""The offline Python API: `LLM("smollm2-135m").generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from crossfill.engine.engine import EngineConfig, LLMEngine
from crossfill.engine.sampling import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0


class LLM:
    """Batch generation on a local engine; prompts run together with continuous batching."""

    def __init__(self, model: str = "smollm2-135m", **engine_kwargs: Any) -> None:
        self.engine = LLMEngine.from_model(model, EngineConfig(**engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | None = None,
        *,
        namespace: str = "",
    ) -> list[CompletionOutput]:
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = []
        for prompt in prompts:
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, params, namespace=namespace)
            ids.append(rid)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        done: dict[str, tuple[str | None, int, int]] = {}
        prompt_ids = {rid: list(self.engine.requests[rid].prompt_ids) for rid in ids}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.new_text)
                if out.finished:
                    done[out.request_id] = (out.finish_reason, out.num_cached_tokens, 0)
        return [
            CompletionOutput(prompt_ids[rid], tokens[rid], "".join(texts[rid]), done[rid][0], done[rid][1])
            for rid in ids
        ]

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> CompletionOutput:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return self.generate([list(ids)], params)[0]
