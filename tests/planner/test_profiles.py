"""Prefill/decode profiles: interpolation and the errors bad profiles give."""

from __future__ import annotations

import pytest

from crossfill.planner.errors import PlanError
from crossfill.planner.profiles import DecodeProfile, PrefillProfile


def test_prefill_profile_interpolates_and_extrapolates() -> None:
    p = PrefillProfile.from_mapping({"lengths": [1000, 2000, 4000], "seconds": [1.0, 3.0, 7.0]}, "prefill")
    assert p.seconds_at(1500) == pytest.approx(2.0)
    assert p.seconds_at(500) == pytest.approx(0.5)  # proportional below the first point
    assert p.seconds_at(6000) == pytest.approx(11.0)  # last segment's slope
    assert not p.covers(6000)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"lengths": [1000, 1000], "seconds": [1, 2]}, r"prefill.lengths\[1\]: 1000 is not greater"),
        ({"lengths": [1000, 500], "seconds": [1, 2]}, r"prefill.lengths\[1\]: 500 is not greater"),
        ({"lengths": [1000, 2000], "seconds": [1, -2]}, r"prefill.seconds\[1\]: -2 is negative"),
        ({"lengths": [1000, 2000], "seconds": [1]}, "'lengths' has 2 entries but 'seconds' has 1"),
        ({"lengths": [1000]}, "expected 'lengths' and 'seconds'"),
        ({"tps": -5}, "must be > 0"),
    ],
)
def test_bad_prefill_profiles(data: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        PrefillProfile.from_mapping(data, "prefill")


def test_decode_batch_is_the_largest_meeting_the_slo() -> None:
    # 10 ms at batch 1, +0.5 ms per extra sequence: 30 ms is reached exactly at batch 41.
    d = DecodeProfile.from_mapping({"batch": [1, 101], "tpot_ms": [10, 60], "slo_ms": 30, "output_len": 100})
    assert d.max_batch() == 41
    assert d.requests_per_second() == pytest.approx(41 / (0.030 * 100))
    tighter = DecodeProfile.from_mapping({"batch": [1, 101], "tpot_ms": [10, 60], "slo_ms": 29.9, "output_len": 100})
    assert tighter.max_batch() == 40


def test_impossible_slo_names_the_field() -> None:
    with pytest.raises(PlanError, match="decode.slo_ms: 5 ms is below the fastest step"):
        DecodeProfile.from_mapping({"batch": [1, 8], "tpot_ms": [12, 20], "slo_ms": 5, "output_len": 100})


def test_kv_capacity_caps_the_decode_batch() -> None:
    d = DecodeProfile.from_mapping(
        {"batch": [1, 101], "tpot_ms": [10, 60], "slo_ms": 30, "output_len": 100, "kv_capacity_gb": 10}
    )
    assert d.max_batch() == 41  # without a request size only the SLO binds
    assert d.max_batch(kv_bytes_per_request=1e9) == 10
    assert d.requests_per_second(1e9) == pytest.approx(10 / (0.0145 * 100))
    with pytest.raises(PlanError, match="decode.kv_capacity_gb: 10 GB cannot hold one mean request"):
        d.max_batch(kv_bytes_per_request=20e9)
