"""Measured (or assumed) hardware profiles: prefill time against prompt length, decode step time
against batch size, and the YAML file that gathers them for `crossfill plan --profile`.

Prefill time between measured lengths is interpolated linearly; beyond the last point it is
extrapolated along the last segment (attention makes real prefill slightly super-linear, so long
extrapolations are optimistic; the report warns when lengths leave the measured range).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from crossfill.planner.errors import PlanError


def _number_list(data: Any, field: str, *, min_len: int = 1) -> np.ndarray:
    if not isinstance(data, list) or len(data) < min_len:
        raise PlanError(f"{field}: expected a list of at least {min_len} numbers")
    try:
        arr = np.asarray([float(x) for x in data])
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{field}: expected numbers ({exc})") from exc
    if not np.all(np.isfinite(arr)):
        raise PlanError(f"{field}: expected finite numbers")
    return arr


def _increasing(arr: np.ndarray, field: str) -> None:
    if arr[0] <= 0:
        raise PlanError(f"{field}[0]: {arr[0]:g} must be > 0")
    for i in range(1, len(arr)):
        if arr[i] <= arr[i - 1]:
            raise PlanError(
                f"{field}[{i}]: {arr[i]:g} is not greater than {field}[{i - 1}] = {arr[i - 1]:g}; "
                "expected strictly increasing values"
            )


def _non_negative(arr: np.ndarray, field: str) -> None:
    for i, value in enumerate(arr):
        if value < 0:
            raise PlanError(f"{field}[{i}]: {value:g} is negative; expected a time >= 0")


@dataclass(frozen=True)
class PrefillProfile:
    """Prefill latency of one instance against prompt length (one request at a time)."""

    lengths: np.ndarray  # tokens, strictly increasing
    seconds: np.ndarray
    kv_bytes: np.ndarray | None = None  # measured KV bytes at those lengths (calibration), if known
    source: str = ""

    @classmethod
    def from_tps(cls, tokens_per_second: float, source: str = "") -> PrefillProfile:
        """Constant throughput: time = length / tps."""
        if not tokens_per_second > 0:
            raise PlanError(f"--prefill-tps: {tokens_per_second} must be > 0 tokens/s")
        return cls(np.array([1.0]), np.array([1.0 / tokens_per_second]), source=source or f"{tokens_per_second:g} tok/s")

    @classmethod
    def from_mapping(cls, data: Any, field: str) -> PrefillProfile:
        """``{tps: X}`` or ``{lengths: [...], seconds: [...], kv_bytes: [...]?}``."""
        if not isinstance(data, dict):
            raise PlanError(f"{field}: expected a mapping with 'tps' or 'lengths' and 'seconds'")
        if "tps" in data:
            try:
                tps = float(data["tps"])
            except (TypeError, ValueError) as exc:
                raise PlanError(f"{field}.tps: expected a number of tokens/s") from exc
            if not tps > 0:
                raise PlanError(f"{field}.tps: {tps:g} must be > 0 tokens/s")
            return cls.from_tps(tps, source=f"{field}.tps {tps:g} tok/s")
        if "lengths" not in data or "seconds" not in data:
            raise PlanError(f"{field}: expected 'lengths' and 'seconds' lists (or 'tps')")
        lengths = _number_list(data["lengths"], f"{field}.lengths")
        seconds = _number_list(data["seconds"], f"{field}.seconds")
        if len(lengths) != len(seconds):
            raise PlanError(f"{field}: 'lengths' has {len(lengths)} entries but 'seconds' has {len(seconds)}")
        _increasing(lengths, f"{field}.lengths")
        _non_negative(seconds, f"{field}.seconds")
        if seconds[-1] <= 0:
            raise PlanError(f"{field}.seconds: all zero; expected positive prefill times")
        kv = None
        if data.get("kv_bytes") is not None:
            kv = _number_list(data["kv_bytes"], f"{field}.kv_bytes")
            if len(kv) != len(lengths):
                raise PlanError(f"{field}.kv_bytes: {len(kv)} entries, expected {len(lengths)} (one per length)")
        default_source = f"{field} profile ({len(lengths)} points, {lengths[0]:.0f}-{lengths[-1]:.0f} tokens)"
        return cls(lengths, seconds, kv, source=str(data.get("source", default_source)))

    def seconds_at(self, lengths: np.ndarray | float) -> np.ndarray:
        x = np.asarray(lengths, dtype=float)
        L, T = self.lengths, self.seconds
        if len(L) == 1:
            return x * (T[0] / L[0])
        inside = np.interp(x, L, T)
        below = x * (T[0] / L[0])  # proportional below the first point
        slope = (T[-1] - T[-2]) / (L[-1] - L[-2])
        above = T[-1] + (x - L[-1]) * slope
        return np.where(x < L[0], below, np.where(x > L[-1], above, inside))

    def covers(self, length: float) -> bool:
        return len(self.lengths) == 1 or length <= self.lengths[-1]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lengths": self.lengths.tolist(), "seconds": self.seconds.tolist()}
        if self.kv_bytes is not None:
            out["kv_bytes"] = self.kv_bytes.tolist()
        return out


@dataclass(frozen=True)
class DecodeProfile:
    """Decode step time (TPOT) of one instance against its batch size, and the TPOT SLO."""

    batch: np.ndarray  # strictly increasing batch sizes
    tpot_s: np.ndarray
    slo_s: float
    output_len: float
    kv_capacity_bytes: float | None = None  # KV memory of one decode instance, if it bounds the batch

    @classmethod
    def from_mapping(cls, data: Any, field: str = "decode") -> DecodeProfile:
        if not isinstance(data, dict):
            raise PlanError(f"{field}: expected a mapping with batch, tpot_ms, slo_ms, output_len")
        for key in ("batch", "tpot_ms", "slo_ms", "output_len"):
            if key not in data:
                raise PlanError(f"{field}.{key}: missing")
        batch = _number_list(data["batch"], f"{field}.batch")
        tpot = _number_list(data["tpot_ms"], f"{field}.tpot_ms") / 1000.0
        if len(batch) != len(tpot):
            raise PlanError(f"{field}: 'batch' has {len(batch)} entries but 'tpot_ms' has {len(tpot)}")
        _increasing(batch, f"{field}.batch")
        for i, v in enumerate(tpot):
            if v <= 0:
                raise PlanError(f"{field}.tpot_ms[{i}]: {v * 1000:g} must be > 0 ms")
        try:
            slo, out_len = float(data["slo_ms"]) / 1000.0, float(data["output_len"])
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{field}: slo_ms and output_len must be numbers") from exc
        if slo <= 0:
            raise PlanError(f"{field}.slo_ms: {slo * 1000:g} must be > 0 ms")
        if out_len <= 0:
            raise PlanError(f"{field}.output_len: {out_len:g} must be > 0 tokens")
        capacity = None
        if data.get("kv_capacity_gb") is not None:
            try:
                capacity = float(data["kv_capacity_gb"]) * 1e9
            except (TypeError, ValueError) as exc:
                raise PlanError(f"{field}.kv_capacity_gb: expected a number of GB") from exc
            if capacity <= 0:
                raise PlanError(f"{field}.kv_capacity_gb: {capacity / 1e9:g} must be > 0 GB")
        profile = cls(batch, tpot, slo, out_len, capacity)
        profile.max_batch()  # an impossible SLO is an input error, found now
        return profile

    def tpot_at(self, batch: np.ndarray | float) -> np.ndarray:
        return np.interp(np.asarray(batch, dtype=float), self.batch, self.tpot_s)

    def max_batch(self, kv_bytes_per_request: float = 0.0) -> int:
        """Largest batch (up to the profile's largest) whose step time meets the SLO and whose KV
        (`kv_bytes_per_request` each, prompt plus output) fits the instance's KV capacity."""
        if self.tpot_at(self.batch[0]) > self.slo_s:
            raise PlanError(
                f"decode.slo_ms: {self.slo_s * 1000:g} ms is below the fastest step of the decode profile "
                f"({self.tpot_s[0] * 1000:g} ms at batch {self.batch[0]:g}); expected an SLO the hardware can meet"
            )
        candidates = np.arange(int(self.batch[0]), int(self.batch[-1]) + 1)
        ok = candidates[self.tpot_at(candidates) <= self.slo_s + 1e-12]
        batch = int(ok[-1])
        if self.kv_capacity_bytes is not None and kv_bytes_per_request > 0:
            fits = int(self.kv_capacity_bytes // kv_bytes_per_request)
            if fits < 1:
                raise PlanError(
                    f"decode.kv_capacity_gb: {self.kv_capacity_bytes / 1e9:g} GB cannot hold one mean request's KV "
                    f"({kv_bytes_per_request / 1e9:.3g} GB); expected more KV memory per decode instance"
                )
            batch = min(batch, fits)
        return batch

    def requests_per_second(self, kv_bytes_per_request: float = 0.0) -> float:
        """Requests one decode instance finishes per second at its largest allowed batch."""
        b = self.max_batch(kv_bytes_per_request)
        return float(b / (float(self.tpot_at(b)) * self.output_len))


def read_yaml(path: str | Path, option: str = "--profile", what: str = "a YAML profile",
              error: type[ValueError] = PlanError) -> dict[str, Any]:
    """A YAML file holding a mapping; `error` names `option` and what was expected (CLI input)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{option}: file {p} does not exist; expected {what}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise error(f"{option}: {p} is not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{option}: {p} must hold a mapping at the top level")
    return data
