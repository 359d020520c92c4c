"""Fixtures for the model-files tests: an isolated $CROSSFILL_HOME and tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty crossfill cache for one test."""
    path = tmp_path / "crossfill-home"
    monkeypatch.setenv("CROSSFILL_HOME", str(path))
    monkeypatch.delenv("CROSSFILL_WHEELHOUSE", raising=False)
    return path
