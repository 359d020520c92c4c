"""Resolve `--model`: a preset name (or Hugging Face id alias) or a path to a ``config.json``.

Presets live in ``presets/*.json``: each holds the real config fields of a public model, the URLs
they come from and notes; they go through the same `model_from_hf_config` as any user file, so a
preset is tested exactly like a downloaded config.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from crossfill.planner.errors import PlanError
from crossfill.planner.hf_config import model_from_hf_config
from crossfill.planner.kv_accounting import ModelKV

PRESET_DIR = Path(__file__).with_name("presets")


@lru_cache(maxsize=1)
def _presets() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(PRESET_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        data["key"] = path.stem
        out[path.stem] = data
    return out


def preset_names() -> list[str]:
    """Canonical preset keys, e.g. ``llama-3.1-8b``."""
    return list(_presets())


def preset_data(name: str) -> dict[str, Any]:
    """The raw preset record (name, aliases, sources, notes, config) for a key or alias."""
    wanted = name.strip().lower()
    for key, data in _presets().items():
        names = {key, data["name"].lower(), *(a.lower() for a in data.get("aliases", []))}
        if wanted in names:
            return data
    raise PlanError(f"--model: unknown preset {name!r}; expected a config.json path or one of {', '.join(_presets())}")


def load_model(name_or_path: str) -> ModelKV:
    """A preset (by key, display name or HF id) or a config.json file (or a directory holding one)."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"--model: cannot read {path} as JSON ({exc}); expected a Hugging Face config.json") from exc
        return model_from_hf_config(config, name=path.parent.name or path.stem, source=str(path))
    if name_or_path.endswith(".json"):
        raise PlanError(f"--model: file {name_or_path} does not exist; expected a config.json path or a preset name")
    data = preset_data(name_or_path)
    model = model_from_hf_config(
        data["config"],
        name=data["name"],
        sliding_keep=data.get("sliding_keep", "window"),
        source="; ".join(data.get("sources", [])),
    )
    return model
