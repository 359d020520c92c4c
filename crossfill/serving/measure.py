"""`crossfill measure-ttft`: TTFT of local vs remote prefill on a topology, split into stages.

For one short and one long prompt it sends greedy requests with `prefill_policy` local_only and
remote_required through the gateway and reads each response's `crossfill` route report: queue,
prefill, transfer (prefill end to KV verified at decode), first decode step, TTFT as the gateway
measured it, and KV raw vs wire bytes. It also prints what layer-wise pipelining predicts for the
remote path: TTFT - prefill ~ one layer's KV over the link + one round trip (+ queueing and the
first decode step). With `--config` alone it starts the topology itself (as `crossfill up`) and
stops it afterwards; with `--url` it measures a running gateway.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import httpx

from crossfill.config import CrossfillConfig, load_config

FILLER = ("Prefill-as-a-service moves the compute-heavy first pass of a long prompt to a remote pool, "
          "and the KV cache crosses the datacenter link to the decode pool near the user. ")


def make_prompt(cfg: CrossfillConfig, tokens: int) -> str:
    from crossfill.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(cfg.model.name, pull=False))
    text = ""
    while len(tok.encode(text)) < tokens:
        text += FILLER
    ids = tok.encode(text)[:tokens]
    return str(tok.decode(ids))


def one(url: str, model: str, prompt: str, policy: str, max_tokens: int, api_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(url + "/v1/completions", timeout=600, headers=headers, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "prefill_policy": policy})
    if r.status_code != 200:
        raise RuntimeError(f"{policy}: HTTP {r.status_code}: {r.text}")
    body = r.json()
    return {**body["crossfill"], "prompt_tokens": body["usage"]["prompt_tokens"]}


def measure(cfg: CrossfillConfig, url: str, short_tokens: int, long_tokens: int, repeats: int,
            api_key: str | None = None) -> list[str]:
    model = cfg.model.api_name
    out = [f"model {cfg.model.name}; kv_cache {cfg.inference_service.kv_cache.compression_mode} "
           f"codec {cfg.inference_service.kv_cache.codec}; median of {repeats} greedy requests, max_tokens 2"]
    links = [lk for lk in cfg.topology.links]
    if links:
        lk = links[0]
        out.append(f"link {lk.between[0]}<->{lk.between[1]}: {lk.bandwidth_gbps:g} Gbit/s, {lk.latency_ms:g} ms one way")
    one(url, model, "warm up", "local_only", 2, api_key)
    one(url, model, "warm up", "remote_required", 2, api_key)
    out.append("prefix cache: every request starts with its own sentence, so none reuses cached KV")
    header = (f"{'prompt':>6} {'tokens':>6} {'route':>6} {'TTFT':>8} {'queue':>7} {'prefill':>8} {'transfer':>8} "
              f"{'1st dec':>7} {'KV raw':>11} {'KV wire':>11} {'ratio':>5}")
    out += ["", header, "-" * len(header)]
    notes = []
    long_prompt_tokens = long_tokens
    for label, n in (("short", short_tokens), ("long", long_tokens)):
        prompt = make_prompt(cfg, n)
        for policy in ("local_only", "remote_required"):
            # A distinct first sentence per request: no run may reuse another's KV via the prefix cache.
            runs = [one(url, model, f"Request {i} via {policy}. {prompt}", policy, 2, api_key) for i in range(repeats)]
            t = {k: statistics.median(r["timings_ms"].get(k, 0.0) for r in runs)
                 for k in ("first_token", "queue", "prefill", "transfer", "first_decode")}
            raw, wire = runs[-1]["kv_raw_bytes"], runs[-1]["kv_wire_bytes"]
            if label == "long":
                long_prompt_tokens = runs[-1]["prompt_tokens"]
            route = runs[-1]["route"]
            out.append(f"{label:>6} {runs[-1]['prompt_tokens']:>6} {route:>6} {t['first_token']:>6.0f}ms "
                       f"{t['queue']:>5.0f}ms {t['prefill']:>6.0f}ms {t['transfer']:>6.0f}ms "
                       f"{t['first_decode']:>5.0f}ms {raw:>11,} {wire:>11,} {raw / max(wire, 1):>5.2f}")
            if route == "remote" and links:
                lk = links[0]
                layers = _num_layers(cfg)
                layer_ms = wire / max(layers, 1) * 8 / (lk.bandwidth_gbps * 1e9) * 1000
                predicted = layer_ms + 2 * lk.latency_ms
                notes.append(f"{label} remote: TTFT - prefill = {t['first_token'] - t['prefill']:.0f} ms; one layer's "
                             f"KV over the link ({wire / max(layers, 1):,.0f} B) {layer_ms:.1f} ms + one round trip "
                             f"{2 * lk.latency_ms:.0f} ms = {predicted:.0f} ms (the rest: queue "
                             f"{t['queue']:.0f} ms, first decode {t['first_decode']:.0f} ms)")
    full = _unpruned_kv_bytes(cfg, long_prompt_tokens)
    if full:
        notes.append(f"long prompt ({long_prompt_tokens} tokens) KV without window pruning (every layer keeps every token, fp32): {full:,} B")
    return out + [""] + notes


def _unpruned_kv_bytes(cfg: CrossfillConfig, tokens: int) -> int:
    """K+V bytes of `tokens` tokens if every layer kept all of them, from the model's config."""
    from crossfill.models import load_config as load_model_config
    from crossfill.models import resolve_model

    mc = load_model_config(resolve_model(cfg.model.name, pull=False))
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    return int(mc.num_hidden_layers * 2 * kv_heads * head_dim * 4 * tokens)


def _num_layers(cfg: CrossfillConfig) -> int:
    from crossfill.models import load_config as load_model_config
    from crossfill.models import resolve_model

    return int(load_model_config(resolve_model(cfg.model.name, pull=False)).num_hidden_layers)


def run_measure(config_path: str, url: str | None, short_tokens: int, long_tokens: int, repeats: int,
                api_key: str | None = None) -> int:
    from crossfill.security.keys import client_api_key

    cfg = load_config(config_path)
    api_key = api_key or client_api_key(cfg)  # --api-key, else the config's first dev key (security.auth on)
    if url is not None:
        print("\n".join(measure(cfg, url, short_tokens, long_tokens, repeats, api_key)))
        return 0
    from crossfill.serving.up import probe_tls, start_children, stop_children, wait_ready

    children = start_children(cfg, config_path)
    try:
        why = wait_ready(children, cfg.serving.startup_timeout_s, [False], probe_tls(cfg))
        if why is not None:
            print(f"measure-ttft: {why}", file=sys.stderr)
            return 1
        import time

        time.sleep(2 * cfg.serving.health_check_interval_ms / 1000 + 0.5)  # let the scheduler see everyone
        gw = cfg.topology.gateway
        print("\n".join(measure(cfg, f"http://{gw.host}:{gw.port}", short_tokens, long_tokens, repeats, api_key)))
        return 0
    finally:
        stop_children(children)
