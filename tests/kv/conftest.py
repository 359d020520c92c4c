"""Fixtures for the KV transfer tests."""

from __future__ import annotations

import pytest

from .helpers import TLSFiles, make_tls_files


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))
