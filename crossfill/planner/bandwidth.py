"""The link question for one model on one prefill pool: how many bits per second leave it.

KV throughput of a prefill instance, Phi = KV bytes of a request / its prefill time, is the rate
at which that instance produces bytes for the inter-DC link while it is busy. N busy instances
need N x Phi of egress; a link of B bits/s carries at most B / (8 x KV bytes) requests per second.
Each answer is also recomputed with a quantised KV dtype and, for hybrid models, with every layer
turned into global attention, so the report can say whether compression or the hybrid layout is
what makes the link sufficient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from crossfill.planner.dtypes import KV_DTYPES, KVDtype
from crossfill.planner.kv_accounting import ModelKV
from crossfill.planner.profiles import PrefillProfile
from crossfill.planner.workload import Workload


@dataclass(frozen=True)
class LinkCase:
    """One (model variant, dtype, length) answer."""

    label: str
    dtype: str
    context_len: float
    kv_bytes: float  # per request
    prefill_seconds: float
    phi_gbps: float  # per busy prefill instance
    pool_egress_gbps: float  # N instances busy
    link_max_rps: float | None  # requests/s whose KV the link carries
    link_share_of_pool: float | None  # that rate / the pool's prefill rate (capped at 1)
    fits: bool | None

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def link_case(
    model: ModelKV,
    dtype: KVDtype,
    state_dtype: KVDtype,
    context_len: float,
    prefill: PrefillProfile,
    instances: int,
    link_gbps: float | None,
    label: str = "",
    kv_bytes: float | None = None,
    prefill_seconds: float | None = None,
) -> LinkCase:
    """The answer at one context length (or, with kv_bytes/prefill_seconds given, for means)."""
    kv = float(kv_bytes if kv_bytes is not None else model.request_bytes(int(round(context_len)), dtype, state_dtype))
    secs = float(prefill_seconds if prefill_seconds is not None else prefill.seconds_at(context_len))
    phi = kv * 8 / secs / 1e9 if secs > 0 else float("inf")
    egress = phi * instances
    if link_gbps is None:
        max_rps = share = fits = None
    else:
        max_rps = link_gbps * 1e9 / 8 / kv if kv > 0 else float("inf")
        pool_rps = instances / secs if secs > 0 else float("inf")
        share = min(1.0, max_rps / pool_rps) if pool_rps > 0 else 1.0
        fits = egress <= link_gbps
    return LinkCase(label or model.name, dtype.name, context_len, kv, secs, phi, egress, max_rps, share, fits)


def workload_case(
    model: ModelKV,
    dtype: KVDtype,
    state_dtype: KVDtype,
    workload: Workload,
    prefill: PrefillProfile,
    instances: int,
    link_gbps: float | None,
    label: str = "",
) -> LinkCase:
    """A pool busy with random requests of the workload: Phi = E[KV] / E[prefill time]."""

    mean_kv = workload.expect(model.kv_function(dtype, state_dtype))
    mean_secs = workload.expect(prefill.seconds_at)
    return link_case(
        model, dtype, state_dtype, workload.mean(), prefill, instances, link_gbps,
        label=label or f"{model.name} (workload mean)", kv_bytes=mean_kv, prefill_seconds=mean_secs,
    )


def workload_alternatives(
    model: ModelKV,
    dtype: KVDtype,
    state_dtype: KVDtype,
    workload: Workload,
    prefill: PrefillProfile,
    instances: int,
    link_gbps: float | None,
) -> list[LinkCase]:
    """`alternatives` for a pool busy with the whole workload."""
    return _variants(model, dtype, lambda m, d, label: workload_case(
        m, d, state_dtype, workload, prefill, instances, link_gbps, label=label))


def alternatives(
    model: ModelKV,
    dtype: KVDtype,
    state_dtype: KVDtype,
    context_len: float,
    prefill: PrefillProfile,
    instances: int,
    link_gbps: float | None,
) -> list[LinkCase]:
    """The same question with smaller KV dtypes and, for hybrid models, without the hybrid layout."""
    return _variants(model, dtype, lambda m, d, label: link_case(
        m, d, state_dtype, context_len, prefill, instances, link_gbps, label=label))


def _variants(
    model: ModelKV, dtype: KVDtype, case: Callable[[ModelKV, KVDtype, str], LinkCase]
) -> list[LinkCase]:
    """`case` for smaller KV dtypes (fp8, int4) and, for a hybrid model, its dense equivalent."""
    out = [
        case(model, alt, f"{model.name} as {alt.name}")
        for alt in (KV_DTYPES["fp8"], KV_DTYPES["int4"])
        if alt.bits < dtype.bits
    ]
    if model.is_hybrid:
        dense = model.dense_equivalent()
        out.append(case(dense, dtype, dense.name))
    return out
