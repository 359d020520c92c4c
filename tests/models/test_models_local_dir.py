"""A local Hugging Face directory round-trips through resolve_model and the loaders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from crossfill.models import (
    ModelConfigError,
    ModelCorruptError,
    eos_token_ids,
    load_config,
    load_state_dict,
    load_tokenizer,
    resolve_model,
)

from .helpers import CHAT_TEMPLATE, make_hf_dir, tiny_llama, tiny_tokenizer


def test_hf_dir_round_trip(home: Path, tmp_path: Path) -> None:
    directory = make_hf_dir(tmp_path / "tiny")
    files = resolve_model(str(directory))
    assert files.name == str(directory) and files.path == directory
    assert len(files.fingerprint) == 64

    config = load_config(files)
    assert isinstance(config, transformers.LlamaConfig)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (32, 2, 2)

    reference = tiny_llama(len(tiny_tokenizer()))
    state = load_state_dict(files)
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name
    assert load_state_dict(files, dtype=torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16

    tokenizer = load_tokenizer(files)
    text = "Hello crossfill, the KV cache crosses the link."
    assert tokenizer(text).input_ids == tiny_tokenizer()(text).input_ids
    assert tokenizer.chat_template == CHAT_TEMPLATE
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert eos_token_ids(files) == [2]  # config.json's eos (no generation_config.json overrides it)


def test_fingerprint_is_stable_layout_independent_and_weight_sensitive(home: Path, tmp_path: Path) -> None:
    single = resolve_model(str(make_hf_dir(tmp_path / "single")))
    again = resolve_model(str(tmp_path / "single"))
    assert again.fingerprint == single.fingerprint
    sharded_dir = make_hf_dir(tmp_path / "sharded", shard_size="20KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = resolve_model(str(sharded_dir))
    assert sharded.fingerprint == single.fingerprint  # same tensors, different files
    assert set(load_state_dict(sharded)) == set(load_state_dict(single))
    other = resolve_model(str(make_hf_dir(tmp_path / "other", seed=1)))
    assert other.fingerprint != single.fingerprint


def test_generation_config_eos_list_wins(home: Path, tmp_path: Path) -> None:
    directory = make_hf_dir(tmp_path / "tiny")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert eos_token_ids(resolve_model(str(directory))) == [2, 0]


@pytest.mark.parametrize("key", ["num_hidden_layers", "model_type", "vocab_size"])
def test_missing_config_key_is_named(home: Path, tmp_path: Path, key: str) -> None:
    directory = make_hf_dir(tmp_path / "tiny")
    config = json.loads((directory / "config.json").read_text())
    del config[key]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=f"config.json is missing the key '{key}'"):
        resolve_model(str(directory))


def test_missing_files_are_named(home: Path, tmp_path: Path) -> None:
    directory = make_hf_dir(tmp_path / "tiny")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ModelConfigError, match="no tokenizer.json"):
        resolve_model(str(directory))
    no_weights = make_hf_dir(tmp_path / "noweights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match=r"no \*.safetensors"):
        resolve_model(str(no_weights))
    no_config = tmp_path / "empty"
    no_config.mkdir()
    with pytest.raises(ModelConfigError, match="no config.json"):
        resolve_model(str(no_config))


def test_truncated_safetensors_names_the_file_and_the_fix(home: Path, tmp_path: Path) -> None:
    directory = make_hf_dir(tmp_path / "tiny")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelCorruptError) as err:
        resolve_model(str(directory))
    assert str(weights) in str(err.value)
    assert "--force" in str(err.value) and "re-download" in str(err.value)


def test_corrupt_header_after_resolve_fails_at_load(home: Path, tmp_path: Path) -> None:
    directory = make_hf_dir(tmp_path / "tiny")
    files = resolve_model(str(directory))
    weights = directory / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + b"not a safetensors header")
    with pytest.raises(ModelCorruptError, match="model.safetensors is not a readable safetensors file"):
        load_state_dict(files)


def test_copied_cache_entry_keeps_its_fingerprint(home: Path, tmp_path: Path) -> None:
    """A directory resolved by path that is a crossfill cache entry reuses the stored fingerprint."""
    directory = make_hf_dir(tmp_path / "tiny")
    fingerprint = resolve_model(str(directory)).fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    (copy / "crossfill.json").write_text(json.dumps({"cache_format": 1, "fingerprint": fingerprint}))
    assert resolve_model(str(copy)).fingerprint == fingerprint
