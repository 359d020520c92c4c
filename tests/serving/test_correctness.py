"""Greedy output via remote prefill == via local prefill == the colocated engine, token for token."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from serving_cluster import launch_cluster
from serving_helpers import LONG, SHORT, wait_until

from crossfill.engine.llm import LLM
from crossfill.engine.sampling import SamplingParams
from crossfill.models import load_tokenizer, resolve_model

PROMPTS = [SHORT, LONG, "Hello world! Ünïcödé text, emojis 🚀 and numbers 12345 are fine. " * 3]


def served_tokens(url: str, prompt: str, policy: str, stream: bool, max_tokens: int) -> tuple[list[int], dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "prefill_policy": policy, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["token_ids"], r.json()["crossfill"]
    with httpx.stream("POST", url + "/v1/generate", json=body, timeout=300) as s:
        assert s.status_code == 200, s.read()
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    return [t for e in events for t in e.get("token_ids", [])], events[-1]["crossfill"]


def check_equal_paths(url: str, model: str, prompts: list[str], max_tokens: int) -> None:
    tok = load_tokenizer(resolve_model(model, pull=False))
    llm = LLM(model)
    ids = [tok.encode(p) for p in prompts]
    expected = [o.token_ids for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True))]
    for prompt, want in zip(prompts, expected, strict=True):
        for policy, route in (("local_only", "local"), ("remote_required", "remote")):
            for stream in (False, True):
                got, info = served_tokens(url, prompt, policy, stream, max_tokens)
                assert info["route"] == route and info["retries"] == 0
                assert got == want, (policy, stream, prompt[:30])


def test_tiny_model_remote_equals_local_equals_colocated(cluster, tiny_llama_dir: Path) -> None:
    check_equal_paths(cluster.url, str(tiny_llama_dir), PROMPTS, max_tokens=24)


def test_tiny_hybrid_attention_model_prunes_windows_and_stays_exact(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """Gemma-3-style sliding layers: hybrid_attention ships only the window, and output is unchanged."""
    with launch_cluster(str(tiny_gemma3_dir), tmp_path) as c:
        check_equal_paths(c.url, str(tiny_gemma3_dir), [LONG], max_tokens=16)
        _, info = served_tokens(c.url, LONG, "remote_required", False, 4)
        tokens = len(load_tokenizer(resolve_model(str(tiny_gemma3_dir), pull=False)).encode(LONG))
        # 3 of 4 layers keep a 24-token window: far fewer bytes than the full prompt in every layer.
        full = 4 * tokens * 2 * 2 * 16 * 4
        assert info["kv_raw_bytes"] < full * 0.5


@pytest.mark.realmodel
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_models_remote_equals_local_equals_colocated(model: str, tmp_path: Path) -> None:
    try:
        resolve_model(model, pull=False)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{model} is not in the model cache (crossfill models pull {model}): {exc}")
    prompts = ["What is the capital of France?",
               "Explain prefill and decode disaggregation in two sentences. " * 8]
    with launch_cluster(model, tmp_path, served_name=model, kv_memory_mb=256,
                        kv_cache={"timeout_ms": 20000}) as c:
        check_equal_paths(c.url, model, prompts, max_tokens=12)


def test_decode_batches_requests_whose_kv_came_from_different_prefill_instances(cluster) -> None:
    """A local-prefilled and a remote-prefilled request decode together and each keeps its own output."""
    import threading

    alone = {p: served_tokens(cluster.url, LONG, p, False, 400)[0] for p in ("remote_required", "local_only")}
    results: dict[str, tuple[list[int], dict]] = {}
    peak = [0]
    threads = {p: threading.Thread(target=lambda p=p: results.__setitem__(p, served_tokens(cluster.url, LONG, p,
                                                                                            True, 400)))
               for p in alone}
    threads["remote_required"].start()
    # The remote one holds decode blocks; the local one starts while it has ~400 tokens to go.
    wait_until("the remote request reached decode", lambda: cluster.kv("here-decode-0")["active_requests"] >= 1)
    threads["local_only"].start()
    while any(t.is_alive() for t in threads.values()):
        peak[0] = max(peak[0], cluster.kv("here-decode-0")["active_requests"])
        time.sleep(0.005)  # the cluster shares the cores with this loop
    for t in threads.values():
        t.join()
    assert peak[0] == 2, "the two requests never decoded in the same batch"
    for policy, (tokens, _info) in results.items():
        assert tokens == alone[policy]
    assert {results[p][1]["prefill_instance"] for p in alone} == {"here-prefill-0", "far-prefill-0"}
