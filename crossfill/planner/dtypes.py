"""KV cache element types and what one stored vector of them costs, scales included.

Quantised KV caches store a scale (and for asymmetric int4 a zero point) beside the values; for a
link budget those bytes travel too, so they are counted here. The conventions, chosen to match
what common serving engines do:

* ``fp32`` / ``bf16`` / ``fp16``: plain values, no scales.
* ``fp8`` (e4m3): one byte a value and one scale per tensor (vLLM's fp8 KV cache); a per-tensor
  scale does not grow with tokens, so it adds nothing per token.
* ``int8``: one byte a value plus one fp16 scale per head vector per token (per-token, per-head
  symmetric quantisation).
* ``int4``: half a byte a value plus an fp16 scale and an fp16 zero point per group of 32 values
  (KIVI-style asymmetric group quantisation).

A "vector" is what one token stores for one head in one layer (K or V separately), or one MLA
latent; packing is rounded up to whole bytes per vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from crossfill.planner.errors import PlanError

ScaleScope = Literal["none", "tensor", "vector", "group"]


@dataclass(frozen=True)
class KVDtype:
    """How one KV vector of `n` values is stored."""

    name: str
    bits: int
    scale_scope: ScaleScope = "none"
    group: int = 0  # values per scale when scale_scope == "group"
    scale_bytes: int = 0  # bytes of scale (+ zero point) per vector or group

    def vector_bytes(self, values: int) -> int:
        """Bytes one stored vector of `values` elements occupies, its per-token scales included."""
        if values <= 0:
            return 0
        payload = math.ceil(values * self.bits / 8)
        if self.scale_scope == "vector":
            return payload + self.scale_bytes
        if self.scale_scope == "group":
            return payload + math.ceil(values / self.group) * self.scale_bytes
        return payload  # "none" and "tensor": nothing per token

    @property
    def is_quantised(self) -> bool:
        return self.bits < 16


KV_DTYPES: dict[str, KVDtype] = {
    "fp32": KVDtype("fp32", 32),
    "bf16": KVDtype("bf16", 16),
    "fp16": KVDtype("fp16", 16),
    "fp8": KVDtype("fp8", 8, "tensor"),
    "int8": KVDtype("int8", 8, "vector", scale_bytes=2),
    "int4": KVDtype("int4", 4, "group", group=32, scale_bytes=4),
}

_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8_e4m3": "fp8"}


def kv_dtype(name: str, field: str = "--dtype") -> KVDtype:
    """Look up a KV dtype by name (case-insensitive, torch-style aliases accepted)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in KV_DTYPES:
        raise PlanError(f"{field}: unknown KV dtype {name!r}; expected one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[key]
