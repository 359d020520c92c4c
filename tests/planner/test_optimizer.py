"""The threshold/pool optimiser against configurations solved by hand."""

from __future__ import annotations

import numpy as np
import pytest

from crossfill.planner.errors import PlanError
from crossfill.planner.optimizer import ClusterSetup, evaluate, local_only, optimize
from crossfill.planner.profiles import DecodeProfile, PrefillProfile
from crossfill.planner.workload import EmpiricalWorkload, LogNormalWorkload

KV = 1e6  # bytes every request sends, whatever its length


def hand_case(remote: int = 8, link_rps: float = 0.6) -> ClusterSetup:
    """Half the prompts have 1000 tokens, half 9000; prefill runs 1000 tok/s everywhere; a decode
    instance finishes 0.5 req/s (batch 5 at 0.1 s/step meets the 0.2 s SLO, 100 output tokens);
    4 local instances; the link carries `link_rps` requests/s."""
    return ClusterSetup(
        workload=EmpiricalWorkload(np.array([1000.0, 1000.0, 9000.0, 9000.0])),
        remote_prefill=PrefillProfile.from_tps(1000),
        local_prefill=PrefillProfile.from_tps(1000),
        decode=DecodeProfile(np.array([1.0, 5.0]), np.array([0.1, 0.1]), slo_s=0.2, output_len=100),
        remote_instances=remote,
        local_instances=4,
        link_gbps=link_rps * KV * 8 / 1e9,
        kv_bytes=lambda lengths: np.full(np.shape(lengths), KV),
    )


def test_link_bound_optimum_solved_by_hand() -> None:
    # Offload the 9000-token half (p = 0.5): remote compute 8/9 req/s, link 0.6 req/s -> cluster
    # <= 1.2; 1 local prefill serves the 1000-token half at 1 req/s -> <= 2; 3 decoders -> 1.5.
    # Lambda = 1.2 (link-bound). With 2 local prefills, decode caps it at 1.0. Local only: 3
    # prefills at 5 s each -> 0.6 req/s vs 1 decoder at 0.5 -> 0.5.
    best, _ = optimize(hand_case())
    assert best.threshold == 1000
    assert best.offload_share == 0.5
    assert best.offload_mean_len == 9000
    assert (best.local_prefill_instances, best.decode_instances) == (1, 3)
    assert best.throughput_rps == pytest.approx(1.2)
    assert best.bottleneck == "inter-DC link"
    assert best.link_utilisation == pytest.approx(1.0)
    assert best.link_egress_gbps == pytest.approx(1.2 * 0.5 * KV * 8 / 1e9)
    assert local_only(hand_case()).throughput_rps == pytest.approx(0.5)


def test_ample_link_offloads_everything() -> None:
    # Link no longer binds. Half offloaded: remote 8/9 / 0.5 = 1.78, then 1 local prefill + 3
    # decoders cap it at 1.5. All offloaded: remote 8 / 5 s = 1.6 req/s, all 4 local instances
    # decode (2.0 req/s) -> 1.6, the optimum, bound by remote compute.
    best, table = optimize(hand_case(link_rps=100))
    assert best.offload_share == 1.0
    assert (best.local_prefill_instances, best.decode_instances) == (0, 4)
    assert best.throughput_rps == pytest.approx(1.6)
    assert best.bottleneck == "remote prefill compute"
    half = next(e for e in table if e.offload_share == 0.5)
    assert half.throughput_rps == pytest.approx(1.5) and half.bottleneck == "decode"


def test_without_remote_instances_nothing_is_offloaded() -> None:
    best, _ = optimize(hand_case(remote=0))
    assert best.offload_share == 0
    assert best.throughput_rps == pytest.approx(0.5)


def test_evaluate_matches_the_formula_on_a_lognormal_workload() -> None:
    w = LogNormalWorkload.from_median(4000, 1.0, 64, 65536)
    setup = ClusterSetup(
        workload=w,
        remote_prefill=PrefillProfile.from_tps(20000),
        local_prefill=PrefillProfile.from_tps(5000),
        decode=DecodeProfile(np.array([1.0, 64.0]), np.array([0.02, 0.05]), slo_s=0.05, output_len=256),
        remote_instances=2,
        local_instances=10,
        link_gbps=10,
        kv_bytes=lambda lengths: np.asarray(lengths) * 1e4,
    )
    e = evaluate(setup, 8000, 4)
    p = w.share_above(8000)
    remote = min(2 * 20000 / w.mean_above(8000), 10e9 / 8 / (1e4 * w.mean_above(8000)))
    local = 4 * 5000 / w.mean_at_most(8000)
    decode = 6 * 64 / (0.05 * 256)
    assert e.throughput_rps == pytest.approx(min(remote / p, local / (1 - p), decode), rel=1e-6)
    best, table = optimize(setup)
    assert best.throughput_rps >= max(t.throughput_rps for t in table) * (1 - 1e-9)
    assert best.throughput_rps >= e.throughput_rps


def test_bad_split_is_rejected() -> None:
    with pytest.raises(PlanError, match="local prefill instances: 4"):
        evaluate(hand_case(), 1000, 4)


def test_lognormal_and_a_sampled_trace_of_it_agree() -> None:
    """The closed-form/grid path and plain sample means reach the same optimum."""
    lognormal = LogNormalWorkload.from_median(6000, 1.3, 128, 131072)
    rng = np.random.default_rng(0)
    samples = rng.lognormal(np.log(6000), 1.3, 300_000)
    trace = EmpiricalWorkload(samples[(samples >= 128) & (samples <= 131072)])

    def setup(workload: LogNormalWorkload | EmpiricalWorkload) -> ClusterSetup:
        return ClusterSetup(
            workload=workload,
            remote_prefill=PrefillProfile.from_mapping({"lengths": [1024, 131072], "seconds": [0.08, 14.5]}, "r"),
            local_prefill=PrefillProfile.from_mapping({"lengths": [1024, 131072], "seconds": [0.16, 29.0]}, "l"),
            decode=DecodeProfile(np.array([1.0, 256.0]), np.array([0.015, 0.048]), slo_s=0.04, output_len=512),
            remote_instances=4,
            local_instances=12,
            link_gbps=25,
            kv_bytes=lambda lengths: np.asarray(lengths) * 24576.0 + 39.5e6,
        )

    a, _ = optimize(setup(lognormal))
    b, _ = optimize(setup(trace))
    assert b.throughput_rps == pytest.approx(a.throughput_rps, rel=0.01)
    assert b.offload_share == pytest.approx(a.offload_share, abs=0.01)
    assert (b.local_prefill_instances, b.decode_instances) == (a.local_prefill_instances, a.decode_instances)
