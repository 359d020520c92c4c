"""Reuse across the wire and KV memory on demand, through the serving stack (issue 9).

* A second chat turn ships only what decode does not already hold (its earlier turn's KV), and
  still answers exactly like the colocated engine.
* A decode-held-prefix claim that prefill cannot verify falls back to sending everything: more
  bytes, counted, never a wrong token.
* Many concurrent requests without max_tokens ("up to the context") all succeed on a decode
  instance whose KV budget holds far fewer worst cases: memory is taken as sequences grow and
  the engine preempts and recomputes under pressure.
"""

from __future__ import annotations

import concurrent.futures
import functools
from pathlib import Path

import httpx
import openai
import pytest
from serving_cluster import Cluster, launch_cluster

from crossfill.engine.llm import LLM
from crossfill.engine.sampling import SamplingParams
from crossfill.kv.wire import token_digest
from crossfill.models import load_tokenizer, resolve_model

SYSTEM = "You are a careful assistant for datacenter operators. Answer briefly and precisely. " * 6
QUESTION = "Why is decode memory bound?"
FOLLOW_UP = "And prefill?"


def chat(c: Cluster, messages: list[dict], max_tokens: int | None) -> tuple[str, dict]:
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = {} if max_tokens is None else {"max_tokens": max_tokens}
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          extra_body={"prefill_policy": "remote_required"}, **kwargs)
    return resp.choices[0].message.content or "", resp.model_extra["crossfill"]


def colocated(model: Path, messages: list[dict], max_tokens: int | None, context: int | None = None) -> str:
    """The colocated engine's greedy answer; max_tokens None: up to `context`, as the gateway does."""
    tok = load_tokenizer(resolve_model(str(model), pull=False))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    if max_tokens is None:
        assert context is not None
        max_tokens = context - len(ids)
    return _llm(str(model)).generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


@functools.cache
def _llm(model: str) -> LLM:
    return LLM(model)


def test_second_chat_turn_sends_only_the_new_blocks(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with launch_cluster(str(tiny_llama_dir), tmp_path, kv_cache={"codec": "none"}) as c:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        answer1, info1 = chat(c, turn1, 8)
        assert answer1 == colocated(tiny_llama_dir, turn1, 8)
        assert info1["route"] == "remote" and info1["decode_cached_tokens"] == 0
        turn2 = [*turn1, {"role": "assistant", "content": answer1}, {"role": "user", "content": FOLLOW_UP}]
        answer2, info2 = chat(c, turn2, 8)
        assert answer2 == colocated(tiny_llama_dir, turn2, 8)
        assert info2["route"] == "remote" and info2["retries"] == 0
        assert info2["decode_cached_tokens"] > 0, info2
        assert info2["kv_wire_bytes_saved"] > 0
        assert info2["kv_wire_bytes"] <= 0.15 * info1["kv_wire_bytes"], (info1, info2)
        metrics = httpx.get(c.worker_url("here-decode-0") + "/metrics", timeout=5).text
        assert "crossfill_kv_reused_tokens_total" in metrics


def test_unverifiable_prefix_claim_sends_everything(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A claim past the prompt, or one whose digest does not match, costs bytes but never output."""
    with launch_cluster(str(tiny_llama_dir), tmp_path, kv_cache={"codec": "none"}) as c:
        from serving_helpers import LONG, transfer_ticket
        from test_correctness import served_tokens

        want, honest = served_tokens(c.url, LONG, "remote_required", False, 8)
        assert honest["decode_cached_tokens"] == 0
        # Talk to the prefill directly, as a confused decode would. Its KV goes to a port where
        # nobody expects this cache id, so the transfer itself may fail at any point: the verdict on
        # the claim is judged when the job starts, and the counters below say what it was.
        tok = load_tokenizer(resolve_model(str(tiny_llama_dir), pull=False))
        ids = tok.encode(LONG)
        for claim, digest, why in ((len(ids) + 5, token_digest(ids), "claim_out_of_range"),
                                   (32, token_digest(ids[:31]), "digest_mismatch")):
            job = {"request_id": "bad-claim", "cache_id": f"bad-claim.{why}", "prompt_token_ids": ids,
                   "sampling": {"temperature": 0, "max_tokens": 4}, "kv_host": "127.0.0.1",
                   "kv_port": c.cfg.instance("here-decode-0").kv_port, "decode_instance": "here-decode-0",
                   "decode_cached_tokens": claim, "decode_prefix_digest": digest,
                   "ticket": transfer_ticket(c.cfg, "bad-claim")}
            with httpx.stream("POST", c.worker_url("far-prefill-0") + "/v1/prefill", json=job, timeout=30) as r:
                assert r.status_code == 200
                lines = list(r.iter_lines())  # to the stream's end: `done` or `error`
            assert '"event":"done"' in lines[-1] or '"event":"error"' in lines[-1], lines[-1]
            first = [line for line in lines if '"first_token"' in line]
            if first:  # prefill got as far as its first token: it planned to send everything
                assert f'"reuse_refused":"{why}' in first[0] and '"export_from":0' in first[0]
        metrics = httpx.get(c.worker_url("far-prefill-0") + "/metrics", timeout=5).text
        assert 'crossfill_kv_reuse_refused_total{reason="claim_out_of_range"} 1.0' in metrics
        assert 'crossfill_kv_reuse_refused_total{reason="digest_mismatch"} 1.0' in metrics
        again, _ = served_tokens(c.url, LONG, "remote_required", False, 8)
        assert again == want


def test_concurrent_requests_without_max_tokens_all_succeed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """16 chats that may each run to the context limit, on a decode budget of a few worst cases."""
    context = 256
    # 1 MiB of KV: 1024 tokens of the tiny model, while 16 requests could grow to 16 x 256.
    with launch_cluster(str(tiny_llama_dir), tmp_path, model_overrides={"max_model_len": context},
                        decode_kv_memory_mb=1, decode_pool={"max_concurrent_requests": 16},
                        prefill_pool={"max_queue_depth": 16}) as c:
        chats = [[{"role": "user", "content": f"Request number {i}: tell me about datacenter {i}."}] for i in range(16)]
        want = [colocated(tiny_llama_dir, m, None, context) for m in chats]
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def one(messages: list[dict]) -> str:
            resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                  extra_body={"prefill_policy": "local_only"})  # no max_tokens
            return resp.choices[0].message.content or ""

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, chats))
        assert answers == want
        kv = c.kv("here-decode-0")
        assert kv["preemptions"] > 0, kv
        assert kv["blocks_used"] == 0


@pytest.mark.realmodel
def test_example_config_serves_16_chats_without_max_tokens(tmp_path: Path) -> None:
    try:
        resolve_model("smollm2-135m", pull=False)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"smollm2-135m is not in the model cache (crossfill models pull smollm2-135m): {exc}")
    # The example's decode budget (512 MB) and concurrency; short chats, as OpenAI clients send them.
    with launch_cluster("smollm2-135m", tmp_path, served_name="smollm2-135m", kv_memory_mb=256,
                        decode_kv_memory_mb=512, decode_pool={"max_concurrent_requests": 32},
                        prefill_pool={"max_queue_depth": 16}, kv_cache={"timeout_ms": 20000}) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=600)

        def one(i: int) -> str:
            resp = client.chat.completions.create(model="smollm2-135m", temperature=0, messages=[
                {"role": "user", "content": f"What is {i} plus {i}? Answer with the number only."}])
            return resp.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            reasons = list(pool.map(one, range(16)))
        assert all(r in ("stop", "length") for r in reasons), reasons
