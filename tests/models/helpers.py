"""Builders for the model-files tests: tiny Hugging Face directories, GGUF files and wheels.

Everything is made from scratch in milliseconds with the real libraries (transformers,
tokenizers, gguf), so the tests exercise the same code paths as the real models without a
download.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "Prefill is compute bound and decode is memory bound.",
    "The KV cache crosses the datacenter link layer by layer.",
    "Hello world, hello crossfill.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained on three sentences, with ChatML-style special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(vocab_size: int, seed: int = 0) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def make_hf_dir(directory: Path, *, shard_size: str | None = None, seed: int = 0) -> Path:
    """A tiny random Llama saved as a Hugging Face directory (optionally sharded)."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(directory, **kwargs)
    tokenizer.save_pretrained(directory)
    return directory


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; this applies that reordering."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model: transformers.LlamaForCausalLM,
                    tokenizer: transformers.PreTrainedTokenizerFast) -> Path:
    """Write `model` and `tokenizer` as an F32 llama GGUF the way llama.cpp's converter lays it out."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([tok for tok, _ in vocab])
    writer.add_token_types([3 if tok in SPECIALS else 1 for tok, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    for hf_name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy().copy()
        if hf_name == "lm_head.weight":
            continue  # tied to the embedding
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            name = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                data = _llama_cpp_permute(data, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_wheel(wheelhouse: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel (`pip download` accepts it from --find-links) holding `members`."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    norm = dist.replace("-", "_")
    path = wheelhouse / f"{norm}-{version}-py3-none-any.whl"
    info = f"{norm}-{version}.dist-info"
    files = {
        **members,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: crossfill-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", record)
    return path
