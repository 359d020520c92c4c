"""The model cache under `$CROSSFILL_HOME` (default `~/.cache/crossfill`).

Layout::

    $CROSSFILL_HOME/models/<key>/         one finished model: config.json, model.safetensors,
                                          tokenizer.json, tokenizer_config.json,
                                          generation_config.json, crossfill.json
    $CROSSFILL_HOME/models/.<key>.lock    serialises concurrent pulls of the same model
    $CROSSFILL_HOME/tmp/                  downloads and half-built directories (removed after use)

A model directory only ever appears by `os.rename` of a fully written temporary directory whose
`crossfill.json` was written last, so an interrupted pull leaves nothing that looks finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

MANIFEST = "crossfill.json"
# Bump when the cache layout or the conversion changes: older entries are then rebuilt.
CACHE_FORMAT = 1


def crossfill_home() -> Path:
    """Root of crossfill's caches; `$CROSSFILL_HOME` overrides the default."""
    env = os.environ.get("CROSSFILL_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "crossfill"


def models_dir() -> Path:
    return crossfill_home() / "models"


def model_dir(key: str) -> Path:
    return models_dir() / key


def tmp_dir() -> Path:
    path = crossfill_home() / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a finished cache entry, or None if `directory` is not one (or is stale)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("cache_format") != CACHE_FORMAT:
        return None
    return manifest


def is_cached(key: str) -> bool:
    return read_manifest(model_dir(key)) is not None


@contextlib.contextmanager
def pull_lock(key: str) -> Iterator[None]:
    """Hold an exclusive lock while pulling `key`, so two processes never build it twice."""
    models_dir().mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(models_dir() / f".{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"Waiting for another process that is pulling {key} ...", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory under the cache (same filesystem, so renames are atomic)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=tmp_dir()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def install(built: Path, key: str, manifest: dict[str, Any]) -> Path:
    """Write the manifest into `built` and move it into place as cache entry `key`, atomically.

    An existing entry (a `--force` re-pull) is first renamed aside and deleted afterwards, so
    readers see either the old or the new directory, never a mix.
    """
    manifest = {"cache_format": CACHE_FORMAT, **manifest}
    tmp_manifest = built / (MANIFEST + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_manifest, built / MANIFEST)
    target = model_dir(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    old: Path | None = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f"old-{key}-", dir=tmp_dir()))
        os.rename(target, old / key)
    os.rename(built, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
