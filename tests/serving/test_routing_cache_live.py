"""Routing v2 on a live cluster (issue 11): cache-aware and bandwidth-aware decisions, batch requests.

* A repeated system prompt is prefilled once per prefill instance, then reused there.
* A follow-up turn goes to the prefill instance holding its history, even when another is preferred
  by every other rule (the tie-break by name).
* A link slowed at run time with the emulator's control API keeps new long prompts local once the
  scheduler's bandwidth estimate has seen it; speeding it up brings them back to the remote pool.
* A batch request goes to the remote pool, never to local prefill, and says so.

No wall-clock thresholds: every wait is for an event (a route kind, a scheduler state), with a
generous safety-net timeout only against a hang.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
from serving_cluster import launch_cluster
from serving_helpers import SHORT, generate, set_link, unique_long, wait_until

SYSTEM = "You are the operator's assistant for a cross-datacenter inference cluster. " * 5


def route_of(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["crossfill"]


def chat(url: str, messages: list[dict], tenant: str, policy: str = "auto", max_tokens: int = 6) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "prefill_policy": policy, "tenant_id": tenant})
    assert r.status_code == 200, r.text
    return r.json()


def test_repeated_system_prompt_is_prefilled_once_per_instance(cluster) -> None:
    tenant = f"sys-{uuid.uuid4().hex[:8]}"  # a namespace no other test has filled
    infos = [chat(cluster.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}],
                  tenant)["crossfill"] for i in range(5)]
    system_tokens = 64  # SYSTEM is well over four 16-token blocks with the tiny tokenizer
    cold: dict[str, int] = {}
    for info in infos:
        if info["prefill_cached_tokens"] < system_tokens:
            cold[info["prefill_instance"]] = cold.get(info["prefill_instance"], 0) + 1
    assert all(n == 1 for n in cold.values()), (cold, infos)
    # After the first, the system prompt never crosses the WAN again: decode holds it.
    assert all(i["decode_cached_tokens"] >= system_tokens for i in infos[1:]), infos
    assert any(i["prefill_cached_tokens"] >= system_tokens for i in infos), infos


def two_local_prefills(doc: dict) -> None:
    here = doc["topology"]["datacenters"]["here"]
    base = here["prefill"]["port"]
    here["prefill"]["replicas"] = 2  # ports base, base + 1
    here["decode"] = {"port": base + 40, "kv_port": base + 41}


def test_follow_up_turn_goes_to_the_prefill_instance_holding_its_history(tiny_llama_dir: Path,
                                                                          tmp_path: Path) -> None:
    """Conversation A lives on here-prefill-0, B on here-prefill-1; each next turn goes back home.

    Each first turn is placed by draining the other instance meanwhile. The two homes point in
    opposite directions, so no other preference (tie-break by name, measured speed, load) can
    explain both follow-ups: only the KV index can.
    """
    with launch_cluster(str(tiny_llama_dir), tmp_path, edit=two_local_prefills) as c:
        sched = f"http://{c.cfg.topology.scheduler.host}:{c.cfg.topology.scheduler.port}"
        tenant = f"conv-{uuid.uuid4().hex[:8]}"
        turns1 = {home: [{"role": "user", "content": f"Conversation {uuid.uuid4().hex}: tell me about prefill. " * 3}]
                  for home in ("here-prefill-0", "here-prefill-1")}
        answers = {}
        for home, turn1 in turns1.items():
            away = "here-prefill-1" if home == "here-prefill-0" else "here-prefill-0"
            assert httpx.delete(f"{sched}/v1/admin/instances/{away}", timeout=5).status_code == 200
            first = chat(c.url, turn1, tenant, "local_only")
            assert first["crossfill"]["prefill_instance"] == home
            answers[home] = first["choices"][0]["message"]["content"]
            r = httpx.post(sched + "/v1/admin/instances", timeout=5, json={
                "name": away, "role": "prefill", "datacenter": "here", "host": "127.0.0.1", "port": 1})
            assert r.status_code == 200 and r.json()["state"] == "active"
            c.wait_scheduler(lambda v, away=away, home=home: v["instances"][away]["ready"]
                             and v["instances"][home]["kv_index_blocks"] > 0)
        for home, turn1 in turns1.items():
            turn2 = [*turn1, {"role": "assistant", "content": answers[home]},
                     {"role": "user", "content": "And which one needs more memory bandwidth?"}]
            second = chat(c.url, turn2, tenant, "local_only")["crossfill"]
            assert second["prefill_instance"] == home, second
            assert second["prefill_cached_tokens"] >= 48, second


def test_slowed_link_keeps_long_prompts_local_and_speeding_it_up_brings_them_back(tiny_llama_dir: Path,
                                                                                   tmp_path: Path) -> None:
    with launch_cluster(str(tiny_llama_dir), tmp_path) as c:
        # A first remote request: the scheduler learns the KV bytes per token from its transfer.
        assert route_of(generate(c.url, unique_long()))["route"] == "remote"
        c.wait_scheduler(lambda v: v["kv_bytes_per_token"] is not None)
        controls = [c.emulator_control("far-prefill-0", "http"), c.emulator_control("here-decode-0", "kv")]
        for ctl in controls:  # the whole link, both directions of every crossing
            set_link(ctl, bandwidth="4mbit")
        seen: dict = {}

        def stays_local() -> bool:
            seen.update(route_of(generate(c.url, unique_long(), max_tokens=2)))
            return seen["route"] == "local"

        wait_until("new long prompts stay local on the slowed link", stays_local, timeout=180)
        why = f"{seen['route_reason']} {seen['degradation_reason']}"
        assert "bandwidth" in why or "no faster than local prefill" in why, seen
        for ctl in controls:
            set_link(ctl, bandwidth="1gbit")

        def goes_remote() -> bool:
            seen.update(route_of(generate(c.url, unique_long(), max_tokens=2)))
            return seen["route"] == "remote"

        wait_until("long prompts go remote again", goes_remote, timeout=180)


def test_batch_requests_go_to_the_remote_pool_never_local_prefill(cluster) -> None:
    info = route_of(generate(cluster.url, SHORT, request_type="batch"))
    assert info["route"] == "remote" and info["request_type"] == "batch", info
    assert "batch" in info["route_reason"]
    bad = generate(cluster.url, SHORT, request_type="bulk")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_type", bad.text


def test_plan_endpoint_reports_the_slow_timescale(cluster) -> None:
    assert generate(cluster.url, SHORT).status_code == 200  # at least one observed request
    sched = cluster.cfg.topology.scheduler
    plan = httpx.get(f"http://{sched.host}:{sched.port}/v1/admin/plan", timeout=10).json()
    assert plan["live_threshold_tokens"] == 64 and plan["samples"] >= 1, plan
    assert "status" in plan and plan["threshold_source"].startswith(("configured", "retuned")), plan
