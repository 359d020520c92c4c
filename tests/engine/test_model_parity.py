"""Model code parity with Hugging Face transformers on the same random weights (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from crossfill.engine.engine import EngineConfig, LLMEngine
from crossfill.engine.sampling import SamplingParams

COMMON = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)
WINDOW = 8

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    ),
    "mistral-sliding": lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW),
    "qwen2-qkv-bias": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3-qk-norm": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
}


class _Tok:
    """Token ids in, placeholder text out: enough for the engine's detokeniser."""

    def decode(self, ids, **_):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [int(t) for t in text.split()]


def _pair(name: str):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if name.startswith("gemma3"):  # random init leaves Gemma norms at zero; make them matter
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.normal_(0, 0.3)
    engine = LLMEngine(
        config, hf.state_dict(), _Tok(),
        engine_config=EngineConfig(kv_memory_mb=8, block_size=4, max_num_batched_tokens=7),
    )
    return hf, engine


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_through_paged_chunked_prefill(name):
    hf, engine = _pair(name)
    prompt = torch.randint(0, COMMON["vocab_size"], (3 * WINDOW + 5,)).tolist()  # longer than the window
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0]
    worst = 0.0
    for length in (1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 3, len(prompt)):
        rid = f"p{length}"
        engine.add_request(rid, prompt[:length], SamplingParams(temperature=0, max_tokens=1), prefill_only=True)
        result = None
        while engine.has_unfinished():
            for out in engine.step():
                result = out.prefill or result
        assert result is not None and result.first_token_id == int(reference[length - 1].argmax())
        worst = max(worst, (result.logits - reference[length - 1]).abs().max().item())
    assert worst <= 1e-4, f"{name}: max |logit diff| {worst}"


@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma3"])
def test_greedy_generation_matches_transformers(name):
    hf, engine = _pair(name)
    prompts = [torch.randint(0, COMMON["vocab_size"], (n,)).tolist() for n in (3, WINDOW + 2, 4 * WINDOW)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=3 * WINDOW, ignore_eos=True))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3 * WINDOW, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(p):].tolist()
        assert got[str(i)] == ref, f"{name} prompt {i}"
