"""A real mooncake_master on loopback for the Mooncake Store tests (skipped without the wheel)."""

from __future__ import annotations

import pytest


def _mooncake_import_error() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


MOONCAKE_MISSING = _mooncake_import_error()
needs_mooncake = pytest.mark.skipif(
    MOONCAKE_MISSING is not None,
    reason=f"the mooncake module is not importable ({MOONCAKE_MISSING}); "
    "install the 'mooncake' extra (mooncake-transfer-engine-non-cuda) and libibverbs1",
)


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    from crossfill.kv.store import StoreUnavailableError
    from crossfill.kv.store.mooncake_master import MooncakeMaster

    try:
        master = MooncakeMaster(log_dir=tmp_path_factory.mktemp("mooncake-master")).start()
    except StoreUnavailableError as exc:  # e.g. the binary cannot run on this machine
        pytest.skip(f"mooncake_master cannot start here: {exc}")
    yield master
    master.stop()
