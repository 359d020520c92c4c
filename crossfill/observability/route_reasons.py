"""A bounded label for the routing rule that chose a route (`crossfill_routing_decisions_total{reason}`).

`Route.reason` is a sentence with the numbers that decided it ("auto: prompt 80 tokens >=
threshold 64; ..."): right for a log line, unbounded as a label. This maps it to the rule's name.
The patterns follow the sentences `crossfill.policy.routing` writes; one it does not know is
"other" (tests/observability/test_metrics_units.py runs the policy and catches a reworded rule).
"""

from __future__ import annotations

# (prefix or fragment, label), first match wins; the more specific sentences come first.
_RULES: tuple[tuple[str, str], ...] = (
    ("mode colocated", "colocated"),
    ("prefill_policy local_only", "policy_local_only"),
    ("prefill_policy remote_required", "policy_remote_required"),
    ("prefill_policy remote_preferred", "policy_remote_preferred"),
    ("batch: spare remote", "batch_remote"),
    ("batch: spare local", "batch_local"),
    ("auto: local prefill saturated", "local_saturated"),
    ("prefer_remote_prefill is false", "prefer_local"),
    ("but kept local", "long_prompt_kept_local"),
    ("local prefill is full, so remote", "long_prompt_local_full"),
    ("auto: long prompt", "long_prompt_remote_unavailable"),
    (">= threshold", "long_prompt"),
    ("< threshold", "short_prompt"),
)

REASONS = tuple(label for _, label in _RULES) + ("other",)


def reason_label(reason: str) -> str:
    for fragment, label in _RULES:
        if fragment in reason:
            return label
    return "other"
