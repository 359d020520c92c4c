"""Resolve a model name or path to a directory of Hugging Face files, and load what is in it.

`resolve_model` accepts a registry name (pulled and dequantised into the cache on first use), a
local Hugging Face directory (used in place), or a `.gguf` file (dequantised into the cache,
keyed by the file's digest). The loaders read only that directory, so a second start costs one
safetensors read.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from crossfill.models import cache
from crossfill.models.convert import gguf_metadata, gguf_to_hf
from crossfill.models.errors import ModelConfigError, ModelCorruptError, UnknownModelError
from crossfill.models.fetch import fetch_gguf, say, sha256_file
from crossfill.models.registry import REGISTRY, RegistryEntry

# Keys without which no decoder-only model in crossfill can be built.
REQUIRED_CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# config.json keys that describe how a file was written rather than the model itself.
_NON_MODEL_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "architectures")


@dataclass(frozen=True)
class ModelFiles:
    """A model on disk, in Hugging Face layout."""

    name: str  # registry name or the path given
    path: Path  # directory with config.json, *.safetensors, tokenizer.json, ...
    fingerprint: str  # sha256 over the model config and every tensor; identifies the model's math


@dataclass(frozen=True)
class ModelInfo:
    """A registry model as `crossfill models list` shows it."""

    name: str
    description: str
    architecture: str
    source: str
    params: str
    size: int  # bytes downloaded by a pull
    cached: bool
    path: Path  # where the cache entry is (or will be)


def known_models() -> list[ModelInfo]:
    return [
        ModelInfo(name=e.name, description=e.description, architecture=e.architecture, source=e.source,
                  params=e.params, size=e.download_bytes, cached=cache.is_cached(e.name),
                  path=cache.model_dir(e.name))
        for e in REGISTRY.values()
    ]


def resolve_model(name_or_path: str, *, pull: bool = True, force: bool = False) -> ModelFiles:
    """Find (and if needed pull/dequantise) a model; see the module docstring for what is accepted.

    `pull=False` refuses to download or convert: it raises if the model is not ready on disk.
    `force=True` rebuilds a registry or GGUF cache entry even if one exists.
    """
    if name_or_path in REGISTRY:
        return _resolve_registry(REGISTRY[name_or_path], pull=pull, force=force)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _resolve_hf_dir(name_or_path, path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf(name_or_path, path, pull=pull, force=force)
    if path.exists():
        raise UnknownModelError(
            f"{path} is neither a Hugging Face model directory nor a .gguf file; pass a directory with "
            "config.json, *.safetensors and tokenizer.json, or a .gguf file."
        )
    known = ", ".join(REGISTRY)
    raise UnknownModelError(
        f"unknown model {name_or_path!r}: known models are {known} (`crossfill models list`); a local "
        "Hugging Face directory (config.json + *.safetensors + tokenizer.json) or a .gguf path is also accepted."
    )


def _resolve_registry(entry: RegistryEntry, *, pull: bool, force: bool) -> ModelFiles:
    directory = cache.model_dir(entry.name)
    if not force and (files := _cached(entry.name, directory)) is not None:
        return files
    if not pull:
        raise UnknownModelError(
            f"model {entry.name!r} is not in the cache at {directory}; run `crossfill models pull {entry.name}`."
        )
    with cache.pull_lock(entry.name):
        if not force and (files := _cached(entry.name, directory)) is not None:
            return files  # another process finished the pull while we waited for the lock
        start = time.monotonic()
        with cache.scratch_dir(f"pull-{entry.name}-") as work:
            gguf_path, digests = fetch_gguf(entry, work)
            built = work / "model"
            gguf_to_hf(gguf_path, built, entry.fallback_chat_template)
            fingerprint = compute_fingerprint(built)
            cache.install(built, entry.name, {
                "name": entry.name, "source": entry.source, "digests": digests, "fingerprint": fingerprint,
                "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            })
        say(f"{entry.name} ready in {directory} ({time.monotonic() - start:.1f}s)")
    return ModelFiles(entry.name, directory, fingerprint)


# Files every cache entry holds; an entry missing one (deleted by hand) is rebuilt.
CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")


def _cached(name: str, directory: Path) -> ModelFiles | None:
    manifest = cache.read_manifest(directory)
    if manifest is None or not isinstance(manifest.get("fingerprint"), str):
        return None
    if not all((directory / f).is_file() for f in CACHE_FILES):
        return None
    return ModelFiles(name, directory, manifest["fingerprint"])


def verify_model(files: ModelFiles) -> None:
    """Re-hash config and weights and compare with the fingerprint recorded at pull time.

    Costs one read of the weights (about a second for these models), so it runs on explicit
    request (`crossfill models pull NAME` of a cached model), not on every start.
    """
    got = compute_fingerprint(files.path)
    if got != files.fingerprint:
        raise ModelCorruptError(
            f"the files in {files.path} changed since they were written (fingerprint {got[:16]}, expected "
            f"{files.fingerprint[:16]}); run `crossfill models pull {files.name} --force` to rebuild them."
        )


def _resolve_gguf(name: str, path: Path, *, pull: bool, force: bool) -> ModelFiles:
    digest = _gguf_digest(path)
    key = f"gguf-{digest[:16]}"
    directory = cache.model_dir(key)
    if not force and (files := _cached(name, directory)) is not None:
        return files
    if not pull:
        raise UnknownModelError(f"{path} has not been dequantised yet; resolve it once with pull allowed.")
    meta = gguf_metadata(path)
    with cache.pull_lock(key):
        if not force and (files := _cached(name, directory)) is not None:
            return files
        with cache.scratch_dir(f"convert-{key}-") as work:
            built = work / "model"
            fallback = None
            if meta.get("general.architecture") == "gemma3":
                fallback = REGISTRY["gemma3-270m"].fallback_chat_template
            gguf_to_hf(path, built, fallback)
            fingerprint = compute_fingerprint(built)
            cache.install(built, key, {
                "name": str(path), "source": f"file:{path.resolve()}", "digests": {"gguf_sha256": digest},
                "fingerprint": fingerprint,
            })
    return ModelFiles(name, directory, fingerprint)


def _gguf_digest(path: Path) -> str:
    """sha256 of a GGUF, remembered per (path, size, mtime) so later starts skip the hashing."""
    memo = _Memo("gguf-digests.json")
    key, stamp = str(path.resolve()), _stamp([path])
    if (hit := memo.get(key, stamp)) is not None:
        return hit
    digest = sha256_file(path, f"hashing {path.name}")
    memo.put(key, stamp, digest)
    return digest


# ---------------------------------------------------------------------------------------------
# Local Hugging Face directories


def _resolve_hf_dir(name: str, directory: Path) -> ModelFiles:
    manifest = cache.read_manifest(directory)
    if manifest is not None and isinstance(manifest.get("fingerprint"), str):
        return ModelFiles(name, directory, manifest["fingerprint"])  # a cache entry given by path
    config = _read_config_dict(directory)
    _check_required_keys(config, directory / "config.json")
    weight_files(directory)
    if not (directory / "tokenizer.json").is_file():
        raise ModelConfigError(
            f"{directory} has no tokenizer.json; save the tokenizer there "
            "(`AutoTokenizer.from_pretrained(...).save_pretrained(dir)`)."
        )
    memo = _Memo("fingerprints.json")
    key, stamp = str(directory.resolve()), _stamp([directory / "config.json", *weight_files(directory)])
    if (hit := memo.get(key, stamp)) is not None:
        return ModelFiles(name, directory, hit)
    fingerprint = compute_fingerprint(directory)
    memo.put(key, stamp, fingerprint)
    return ModelFiles(name, directory, fingerprint)


def _read_config_dict(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{directory} has no config.json; a Hugging Face model directory needs one.")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelConfigError(f"{path} is not valid JSON ({exc}); restore or re-save the file.") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} must hold a JSON object.")
    return data


def _check_required_keys(config: dict[str, Any], path: Path) -> None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in REQUIRED_CONFIG_KEYS:
        if key not in text and key not in config:
            raise ModelConfigError(f"{path} is missing the key {key!r}; add it (see the model's original config.json).")


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory, sharded or not, in load order."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelCorruptError(f"{index} is not a valid safetensors index ({exc}); re-download the model.") from exc
        files = [directory / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelCorruptError(f"{f} is listed in {index.name} but missing; re-download the model.")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{directory} has no *.safetensors weights (only safetensors is supported).")
    return files


# ---------------------------------------------------------------------------------------------
# Fingerprints


def compute_fingerprint(directory: Path) -> str:
    """sha256 over the model's config (canonical JSON) and every tensor (name, dtype, shape, bytes).

    Hashing tensors rather than files makes the value independent of sharding and file layout,
    and leaving out serialisation-only config keys makes it independent of the transformers
    version that wrote config.json: two directories get the same fingerprint exactly when they
    compute the same function, which is what the KV wire format needs to know.
    """
    config = _read_config_dict(directory)
    for key in _NON_MODEL_CONFIG_KEYS:
        config.pop(key, None)
    digest = hashlib.sha256(b"crossfill-model-fingerprint-v1\n")
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    handles = {file: _open_safetensors(file) for file in weight_files(directory)}
    try:
        where = {key: file for file, handle in handles.items() for key in handle.keys()}
        for key in sorted(where):  # one global order, whatever the sharding
            tensor = handles[where[key]].get_tensor(key).contiguous()
            digest.update(f"\n{key}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
            digest.update(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return digest.hexdigest()


class _Memo:
    """A small JSON map under $CROSSFILL_HOME remembering digests of files by their stat stamps."""

    def __init__(self, filename: str) -> None:
        self.path = cache.crossfill_home() / filename

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: str, stamp: list[Any]) -> str | None:
        hit = self._load().get(key)
        return hit["digest"] if isinstance(hit, dict) and hit.get("stamp") == stamp else None

    def put(self, key: str, stamp: list[Any], digest: str) -> None:
        # Forget paths that are gone (test runs resolve many temporary directories).
        data = {k: v for k, v in self._load().items() if Path(k).exists()}
        data[key] = {"stamp": stamp, "digest": digest}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def _stamp(paths: list[Path]) -> list[Any]:
    return [[p.name, (st := p.stat()).st_size, st.st_mtime_ns] for p in paths]


# ---------------------------------------------------------------------------------------------
# Loaders


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelCorruptError(_corrupt_message(file, exc)) from exc


def _corrupt_message(file: Path, exc: Exception) -> str:
    return (
        f"{file} is not a readable safetensors file ({exc}). It is truncated or corrupt: for a registry "
        "model run `crossfill models pull NAME --force`; for a local directory re-download or re-save the weights."
    )


def load_config(files: ModelFiles) -> Any:
    """The model's `transformers.PretrainedConfig` (the text config for multimodal Gemma 3)."""
    from transformers import AutoConfig

    _check_required_keys(_read_config_dict(files.path), files.path / "config.json")
    try:
        config = AutoConfig.from_pretrained(str(files.path))
    except (ValueError, KeyError, OSError) as exc:
        raise ModelConfigError(f"{files.path / 'config.json'} is not a usable config ({exc}).") from exc
    return config.get_text_config()


def load_state_dict(files: ModelFiles, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors under their Hugging Face names, converted to `dtype`.

    Tied weights are stored once (`lm_head.weight` is absent when `tie_word_embeddings` is set),
    exactly as `transformers` saves them.
    """
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(files.path):
        try:
            with _open_safetensors(file) as handle:
                for key in handle.keys():
                    state[key] = handle.get_tensor(key).to(dtype)
        except SafetensorError as exc:
            raise ModelCorruptError(_corrupt_message(file, exc)) from exc
    return state


def load_tokenizer(files: ModelFiles) -> Any:
    """The fast tokenizer, with its chat template."""
    from transformers import AutoTokenizer

    if not (files.path / "tokenizer.json").is_file():
        raise ModelConfigError(f"{files.path} has no tokenizer.json; save the tokenizer there.")
    try:
        return AutoTokenizer.from_pretrained(str(files.path))
    except (ValueError, OSError) as exc:
        raise ModelCorruptError(
            f"cannot load the tokenizer in {files.path} ({exc}); re-save tokenizer.json or, for a registry "
            "model, run `crossfill models pull NAME --force`."
        ) from exc


def eos_token_ids(files: ModelFiles) -> list[int]:
    """Token ids that end generation: generation_config.json first, then config.json, then the tokenizer."""
    for filename in ("generation_config.json", "config.json"):
        path = files.path / filename
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get("eos_token_id")
            except ValueError as exc:
                raise ModelConfigError(f"{path} is not valid JSON ({exc}); restore or re-save it.") from exc
            if value is not None:
                return [int(v) for v in value] if isinstance(value, list) else [int(value)]
    tokenizer = load_tokenizer(files)
    if tokenizer.eos_token_id is None:
        raise ModelConfigError(f"{files.path} defines no eos_token_id; add it to generation_config.json.")
    return [int(tokenizer.eos_token_id)]
