"""The registry, the CLI and the errors a user sees for names that are not models."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from crossfill.cli import app
from crossfill.models import (
    DEFAULT_MODEL,
    ModelError,
    UnknownModelError,
    known_models,
    resolve_model,
)
from crossfill.models.registry import REGISTRY


def test_known_models_lists_both_models_uncached_in_a_fresh_home(home: Path) -> None:
    infos = {info.name: info for info in known_models()}
    assert set(infos) == {"smollm2-135m", "gemma3-270m"}
    assert DEFAULT_MODEL == "smollm2-135m"
    assert infos["smollm2-135m"].architecture == "llama"
    assert infos["gemma3-270m"].architecture == "gemma3_text"
    for info in infos.values():
        assert info.cached is False
        assert info.path == home / "models" / info.name
        assert info.source.startswith("pypi:") and "==" in info.source
        assert info.size > 10_000_000


def test_every_pinned_digest_is_a_sha256() -> None:
    for entry in REGISTRY.values():
        digests = [entry.gguf_sha256, *(p.sha256 for p in entry.parts)]
        if entry.checksum_listing is not None:
            digests.append(entry.checksum_listing.sha256)
        for digest in digests:
            assert len(digest) == 64 and int(digest, 16) >= 0
        for part in entry.parts:
            assert "==" in part.requirement  # pinned to one release


def test_unknown_name_lists_known_models_and_alternatives(home: Path) -> None:
    with pytest.raises(UnknownModelError) as err:
        resolve_model("llama-9000b")
    message = str(err.value)
    assert isinstance(err.value, ModelError) and isinstance(err.value, ValueError)
    assert "llama-9000b" in message
    assert "smollm2-135m" in message and "gemma3-270m" in message
    assert "Hugging Face directory" in message and ".gguf" in message


def test_existing_file_that_is_not_a_model_is_refused(home: Path, tmp_path: Path) -> None:
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"\0" * 16)
    with pytest.raises(UnknownModelError, match="weights.bin.*neither"):
        resolve_model(str(stray))


def test_uncached_model_without_pull_says_how_to_pull(home: Path) -> None:
    with pytest.raises(UnknownModelError, match="crossfill models pull gemma3-270m"):
        resolve_model("gemma3-270m", pull=False)
    assert not (home / "models" / "gemma3-270m").exists()


def test_cli_list_shows_table_and_pull_of_unknown_fails(home: Path) -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["models", "list"])
    assert listed.exit_code == 0, listed.output
    for column in ("name", "architecture", "params", "cached", "path"):
        assert column in listed.output
    assert "smollm2-135m" in listed.output and "gemma3-270m" in listed.output
    assert str(home / "models") in listed.output
    pulled = runner.invoke(app, ["models", "pull", "no-such-model"])
    assert pulled.exit_code == 1
    assert "unknown model 'no-such-model'" in pulled.output
