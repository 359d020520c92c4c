"""Wire bytes of a multi-turn chat over remote prefill, with and without decode-prefix reuse.

Starts the example cluster twice (the `crossfill up` code path, ports shifted by --port-offset so
a running `make serve` is not disturbed): once with `kv_cache.reuse_decode_prefix: true` (the
default) and once false. Each run holds one conversation of --turns turns (a long system prompt,
short questions, the model's own answers fed back) with `prefill_policy: remote_required`, and
sums the KV wire bytes each turn's route report gives.

    .venv/bin/python bench/reuse.py --config examples/two-dc.yaml --turns 10

Prints per-turn wire bytes of both runs and the ratio of the totals.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
import yaml
from shifted import shift_ports  # bench/shifted.py (scripts run from bench/ on sys.path)

from crossfill.config import load_config
from crossfill.serving.up import probe_tls, start_children, stop_children, wait_ready

SYSTEM = ("You are the operations assistant of a company that runs LLM inference in two datacenters. "
          "Prefill runs in a remote compute-dense pool; the KV cache crosses a WAN link to the local "
          "decode pool. Answer questions about capacity, links and failures briefly and precisely. ") * 4
QUESTIONS = ["What limits decode speed?", "And prefill?", "Why move KV across datacenters?",
             "What if the link is slow?", "How does hybrid attention help?", "What is a prefix cache?",
             "Why checksum KV frames?", "When should a prompt stay local?", "What is TTFT?", "Summarise."]


def shifted(doc: dict, offset: int, reuse: bool) -> dict:
    shift_ports(doc, offset)
    doc["inference_service"]["kv_cache"]["reuse_decode_prefix"] = reuse
    return doc


def conversation(url: str, model: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    infos = []
    with httpx.Client(timeout=600) as client:
        for i in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
            r = client.post(url + "/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "prefill_policy": "remote_required"})
            r.raise_for_status()
            body = r.json()
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            infos.append({**body["crossfill"], "prompt_tokens": body["usage"]["prompt_tokens"]})
    return infos


def run(config: Path, offset: int, reuse: bool, turns: int, max_tokens: int) -> list[dict]:
    doc = shifted(yaml.safe_load(config.read_text()), offset, reuse)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg = load_config(path)
        children = start_children(cfg, str(path))
        try:
            why = wait_ready(children, cfg.serving.startup_timeout_s, [False], probe_tls(cfg))
            if why:
                sys.exit(f"cluster did not start: {why}")
            gw = cfg.topology.gateway
            return conversation(f"http://{gw.host}:{gw.port}", cfg.model.api_name, turns, max_tokens)
        finally:
            stop_children(children)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("examples/two-dc.yaml"))
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--port-offset", type=int, default=1000)
    args = p.parse_args()
    with_reuse = run(args.config, args.port_offset, True, args.turns, args.max_tokens)
    without = run(args.config, args.port_offset, False, args.turns, args.max_tokens)
    print(f"{args.turns}-turn chat, {args.config}: KV wire bytes per turn (remote prefill)")
    print(f"  {'turn':>4} {'prompt tok':>10} {'no reuse':>12} {'reuse':>12} {'held by decode':>15}")
    for i, (a, b) in enumerate(zip(with_reuse, without, strict=True), 1):
        print(f"  {i:>4} {a['prompt_tokens']:>10} {b['kv_wire_bytes']:>12,} {a['kv_wire_bytes']:>12,} "
              f"{a['decode_cached_tokens']:>15}")
    total_a = sum(a["kv_wire_bytes"] for a in with_reuse)
    total_b = sum(b["kv_wire_bytes"] for b in without)
    print(f"  total: no reuse {total_b:,} B, reuse {total_a:,} B -> {total_b / max(total_a, 1):.2f}x fewer bytes")


if __name__ == "__main__":
    main()
