"""Aggregate decode throughput of N concurrent requests without max_tokens: this tree vs a baseline commit.

A request without max_tokens may run to the context limit. An engine that reserves prompt +
max_tokens blocks at admission fits only a few such requests in its KV budget and serves the rest
one after another; one that takes blocks as sequences grow (and preempts under pressure) runs
them together. Both sides run the same prompts, greedy, for the same wall-clock window (an answer
may run to the context limit, so a run to completion could take hours), in separate processes one
after the other: the baseline from a `git worktree` of `--baseline-rev`.

    .venv/bin/python bench/capacity.py --model smollm2-135m --requests 32 --seconds 60 --baseline-rev 5a0f821

Prints generated tokens/s of each side, how many requests were running together, and the ratio
(this tree / baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is {i} plus {i}? Answer with the number only.",
    "Name one colour of the rainbow (answer number {i}).",
    "Say hello to user {i} in one short sentence.",
    "What is the capital of France? This is question {i}.",
]


def worker(model: str, requests: int, kv_memory_mb: int, seconds: float) -> dict[str, float]:
    from crossfill.engine.engine import EngineConfig, LLMEngine
    from crossfill.engine.sampling import SamplingParams

    engine = LLMEngine.from_model(model, EngineConfig(kv_memory_mb=kv_memory_mb, max_num_seqs=requests))
    tok = engine.tokenizer
    prompts = []
    for i in range(requests):
        msg = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(i=i)}]
        ids = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "input_ids") or isinstance(ids, dict) else ids))
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):  # what the gateway sends when max_tokens is omitted
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=engine.max_model_len - len(ids)))
    generated = finished = 0
    most_running = 0
    while engine.has_unfinished() and time.perf_counter() - t0 < seconds:
        outs = engine.step()
        # Requests that produced a token this step were decoding together.
        most_running = max(most_running, sum(1 for o in outs if o.new_token_ids))
        for out in outs:
            generated += len(out.new_token_ids)
            finished += out.finished
    wall = time.perf_counter() - t0
    stats = engine.kv_stats()
    return {"tokens": generated, "seconds": wall, "tokens_per_s": generated / wall, "finished": finished,
            "most_running": most_running, "preemptions": float(getattr(stats, "preemptions", 0))}


def run_side(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model,
           "--requests", str(args.requests), "--kv-memory-mb", str(args.kv_memory_mb), "--seconds", str(args.seconds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_tree(rev: str) -> Path:
    tree = Path(f"/tmp/crossfill-baseline-{rev}")
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
    return tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--kv-memory-mb", type=int, default=512, help="decode KV budget (the example config's)")
    p.add_argument("--seconds", type=float, default=60.0, help="wall-clock window of each side")
    p.add_argument("--baseline-rev", default="5a0f821", help="commit with up-front prompt+max_tokens reservation")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.requests, args.kv_memory_mb, args.seconds)))
        return
    base = run_side(baseline_tree(args.baseline_rev), args)
    mine = run_side(ROOT, args)
    print(f"{args.requests} concurrent requests without max_tokens, {args.model}, kv_memory_mb={args.kv_memory_mb}")
    for name, r in (("baseline " + args.baseline_rev, base), ("this tree", mine)):
        print(f"  {name:<18} {r['tokens']:>6.0f} tokens in {r['seconds']:6.1f} s = {r['tokens_per_s']:6.1f} tok/s; "
              f"up to {r['most_running']:.0f} decoding together, {r['finished']:.0f} finished, "
              f"preemptions {r['preemptions']:.0f}")
    print(f"  ratio this/baseline: {mine['tokens_per_s'] / base['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
