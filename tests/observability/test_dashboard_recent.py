"""The gateway's ring of recent route reports behind /dashboard: bounded, ordered, totals since start."""

from __future__ import annotations

from crossfill.observability.dashboard_api import RecentRoutes
from crossfill.serving.protocol import RouteInfo, Usage


def test_ring_is_bounded_and_totals_count_everything() -> None:
    now = [1000.0]
    recent = RecentRoutes(maxlen=3, clock=lambda: now[0])
    for i in range(5):
        now[0] += 1
        info = RouteInfo(request_id=f"r{i}", route="remote" if i % 2 else "local", prefill_instance="p",
                         decode_instance="d", kv_raw_bytes=100, kv_wire_bytes=40,
                         route_reason="auto: prompt 80 tokens >= threshold 64; sending 1 MB",
                         timings_ms={"first_token": 12.5, "total": 30.0})
        recent.add(info, "ok", None, Usage(prompt_tokens=80, completion_tokens=8))
    recent.add(RouteInfo(request_id=""), "error", "context_length_exceeded")  # refused before a route

    entries = recent.entries()
    assert [e["request_id"] for e in entries] == ["r3", "r4", ""]  # the newest three, oldest first
    assert [e["seq"] for e in entries] == [4, 5, 6]  # grows, so the page adds each request once
    assert entries[0]["rule"] == "long_prompt" and entries[0]["ttft_ms"] == 12.5 and entries[0]["time"] == 1004.0
    assert (entries[-1]["route"], entries[-1]["error_code"], entries[-1]["rule"]) == ("none", "context_length_exceeded",
                                                                                      None)
    assert recent.totals == {"requests": 6, "errors": 1, "route_local": 3, "route_remote": 2, "route_none": 1,
                             "completion_tokens": 40, "prompt_tokens": 400, "kv_raw_bytes": 500, "kv_wire_bytes": 200}
