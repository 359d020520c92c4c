"""Every kv_cache.transport, turned on from the config, serves the same greedy tokens (issue 9).

Each case starts a real cluster (the `crossfill up` code path) whose only difference is the
`kv_cache` block, sends the same long prompt with `remote_required`, and compares the tokens with
the colocated engine. Mooncake cases skip, saying why, where the wheel cannot load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from serving_cluster import free_port_block, launch_cluster
from serving_helpers import LONG
from test_correctness import served_tokens

from crossfill.engine.llm import LLM
from crossfill.engine.sampling import SamplingParams
from crossfill.kv.tls import write_dev_pki
from crossfill.models import load_tokenizer, resolve_model


def _mooncake_reason() -> str | None:
    try:
        from crossfill.kv.transports import check_available

        check_available("mooncake_te", "mooncake")
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        return f"Mooncake cannot load here: {exc}"
    return None


def _kv_block(case: str, tmp_path: Path) -> dict:
    if case == "tcp":
        return {"transport": "tcp"}
    if case == "tcp+tls":
        pki = write_dev_pki(tmp_path / "pki")
        return {"transport": "tcp", "tls": {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]),
                                            "ca_file": str(pki["ca"])}}
    if case == "mooncake_te":
        return {"transport": "mooncake_te"}
    if case == "store-embedded":
        return {"transport": "store", "store": "embedded", "store_memory_mb": 64}
    assert case == "store-mooncake"
    # The master's port comes from a free block below the ephemeral range, like the cluster's own.
    return {"transport": "store", "store": "mooncake", "store_memory_mb": 64,
            "mooncake_master": f"127.0.0.1:{free_port_block(1)}", "start_mooncake_master": True}


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[int]:
    tok = load_tokenizer(resolve_model(str(tiny_llama_dir), pull=False))
    out = LLM(str(tiny_llama_dir)).generate([tok.encode(LONG)], SamplingParams(temperature=0, max_tokens=16,
                                                                                ignore_eos=True))
    return out[0].token_ids


@pytest.mark.parametrize("case", ["tcp", "tcp+tls", "mooncake_te", "store-embedded", "store-mooncake"])
def test_every_transport_gives_the_colocated_greedy_tokens(case: str, tiny_llama_dir: Path, tmp_path: Path,
                                                           expected: list[int]) -> None:
    if "mooncake" in case and (why := _mooncake_reason()):
        pytest.skip(why)
    kv = _kv_block(case, tmp_path)
    with launch_cluster(str(tiny_llama_dir), tmp_path, kv_cache=kv) as c:
        for stream in (False, True):
            got, info = served_tokens(c.url, LONG, "remote_required", stream, 16)
            assert info["route"] == "remote" and info["retries"] == 0, info
            assert info["transport"] == kv["transport"]
            assert info["kv_wire_bytes"] > 0
            assert got == expected, (case, stream)
        stats = c.kv("here-decode-0")
        assert stats["blocks_used"] == 0
