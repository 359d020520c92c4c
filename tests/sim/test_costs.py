"""The simulator's scalar cost functions agree with the planner's vectorised ones."""

from __future__ import annotations

import numpy as np
import pytest

from crossfill.planner.dtypes import KV_DTYPES
from crossfill.planner.model_source import load_model
from crossfill.planner.profiles import DecodeProfile, PrefillProfile
from crossfill.sim.costs import DecodeSteps, KVCost, PrefillTime


@pytest.mark.parametrize("profile", [
    PrefillProfile.from_mapping({"lengths": [1024, 4096, 65536], "seconds": [0.1, 0.3, 6.0]}, "p"),
    PrefillProfile.from_tps(5000.0),
])
def test_prefill_time_matches_the_planner(profile: PrefillProfile) -> None:
    fast = PrefillTime(profile)
    lengths = [1, 100, 1024, 3000, 4096, 40000, 65536, 200000]
    assert [fast(n) for n in lengths] == pytest.approx(profile.seconds_at(np.array(lengths)).tolist())
    assert fast.uncached(4096, 0) == pytest.approx(fast(4096))
    assert fast.uncached(4096, 1024) == pytest.approx(fast(4096) - fast(1024))


def test_decode_steps_tabulate_the_profile() -> None:
    profile = DecodeProfile.from_mapping({"batch": [1, 16, 64], "tpot_ms": [15, 17, 25], "slo_ms": 30,
                                          "output_len": 100})
    steps = DecodeSteps(profile, 64)
    assert steps.tpot[1] == pytest.approx(0.015)
    assert steps.tpot[40] == pytest.approx(float(profile.tpot_at(40)))


@pytest.mark.parametrize("preset", ["gemma-3-27b", "qwen3-next-80b-a3b", "llama-3.1-8b"])
def test_kv_bytes_match_the_planners_accounting(preset: str) -> None:
    model = load_model(preset)
    bf16 = KV_DTYPES["bf16"]
    kv = KVCost.from_model(model, bf16, bf16, codec_ratio=2.0)
    for n in (1, 512, 4096, 40000):
        assert kv.raw_bytes(n) == pytest.approx(model.request_bytes(n, bf16, bf16))
        assert kv.wire_bytes(n) == pytest.approx(model.request_bytes(n, bf16, bf16) / 2)
    assert kv.vectorised(np.array([4096.0]))[0] == pytest.approx(kv.wire_bytes(4096))


def test_decode_held_prefix_is_not_sent_but_the_state_is() -> None:
    kv = KVCost("m", growing_bytes_per_token=100.0, state_bytes=1000.0)
    assert kv.send_bytes(50, 0) == 100 * 50 + 1000
    assert kv.send_bytes(50, 30) == 100 * 20 + 1000
