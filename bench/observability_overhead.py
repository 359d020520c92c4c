"""What metrics + tracing cost: TTFT and throughput with observability off and on, side by side.

    .venv/bin/python bench/observability_overhead.py [--config examples/two-dc.yaml] [--requests 20]
                                                     [--rounds 2] [--concurrency 4] [--max-tokens 32]

Starts the example cluster (the `crossfill up` code path, ports shifted by --port-offset so a running
`make serve` is not disturbed) once per variant and round, alternating (off, on, off, on, ...) so
load that drifts during the run hits both alike, each with its own temporary `security.dir`:

  off: observability.metrics_enabled false, tracing_enabled false (no /metrics, no spans, no ids);
  on:  metrics_enabled true, tracing_enabled true, trace_file set (every span of every process
       written to a JSON-lines file: the exporter's work is included).

Each cluster gets a warm-up, then --requests streamed completions one at a time, alternating a
short prompt (local_only) and a long one (remote_required, so every hop and a KV transfer are
traced), each with its own first sentence so no prefix cache hits, and with ignore_eos so each
makes --max-tokens tokens. TTFT is the client's (request sent to first token received); decode
throughput is tokens after the first over the time after it. Then the same number of requests
from --concurrency clients at once: output tokens per second of wall time. Prints the medians per
variant and the on/off ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from shifted import shift_ports  # bench/shifted.py (scripts run from bench/ on sys.path)

from crossfill.config import load_config
from crossfill.security.keys import client_api_key
from crossfill.serving.measure import make_prompt, one
from crossfill.serving.up import probe_tls, start_children, stop_children, wait_ready

VARIANTS = ("off", "on")
ROUTES = (("local", "local_only"), ("remote", "remote_required"))


@dataclass
class Run:
    variant: str
    ttft_ms: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r, _ in ROUTES})
    decode_tps: list[float] = field(default_factory=list)
    aggregate_tps: list[float] = field(default_factory=list)
    spans: int = 0


def variant_doc(doc: dict[str, Any], offset: int, variant: str, tmp: Path) -> dict[str, Any]:
    """The config of one run: ports shifted, observability switched, secrets and spans under `tmp`."""
    shift_ports(doc, offset)
    sec = doc.setdefault("security", {})
    sec["dir"], sec["audit_dir"] = str(tmp / "security"), str(tmp / "audit")
    obs = doc["inference_service"].setdefault("observability", {})
    on = variant == "on"
    obs.update(metrics_enabled=on, tracing_enabled=on)
    obs.pop("otlp_endpoint", None)
    if on:
        obs["trace_file"] = str(tmp / "spans" / "spans.jsonl")
    else:
        obs.pop("trace_file", None)
    return doc


def streamed(client: httpx.Client, url: str, model: str, prompt: str, policy: str, max_tokens: int,
             headers: dict[str, str]) -> tuple[float, float, int]:
    """(TTFT s, decode seconds after the first token, completion tokens) of one streamed completion."""
    t0 = time.perf_counter()
    t_first: float | None = None
    tokens = 0
    with client.stream("POST", url + "/v1/completions", headers=headers, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "prefill_policy": policy, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{policy}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if t_first is None and '"text":"' in line and '"text":""' not in line:
                t_first = time.perf_counter()
            if '"usage":{' in line:
                tokens = int(line.split('"completion_tokens":', 1)[1].split(",", 1)[0].split("}", 1)[0])
    t_end = time.perf_counter()
    if t_first is None:
        raise RuntimeError(f"{policy}: no token in the stream")
    return t_first - t0, t_end - t_first, tokens


def measure(run: Run, url: str, model: str, prompts: dict[str, str], requests: int, concurrency: int,
            max_tokens: int, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tag = f"{run.variant}-{time.monotonic_ns()}"
    with httpx.Client(timeout=600) as client:
        for i in range(requests):
            route, policy = ROUTES[i % 2]
            ttft, decode_s, tokens = streamed(client, url, model, f"Request {i} ({tag}). {prompts[route]}", policy,
                                              max_tokens, headers)
            run.ttft_ms[route].append(ttft * 1000)
            if tokens > 1 and decode_s > 0:
                run.decode_tps.append((tokens - 1) / decode_s)
    # Concurrent: `concurrency` clients share `requests` requests; output tokens per second of wall time.
    total = [0]
    lock = threading.Lock()
    errors: list[Exception] = []

    def client_loop(k: int) -> None:
        try:
            with httpx.Client(timeout=600) as c:
                for i in range(k, requests, concurrency):
                    route, policy = ROUTES[i % 2]
                    _, _, tokens = streamed(c, url, model, f"Load {i} ({tag}). {prompts[route]}", policy, max_tokens,
                                            headers)
                    with lock:
                        total[0] += tokens
        except Exception as exc:  # noqa: BLE001 - reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    run.aggregate_tps.append(total[0] / (time.perf_counter() - t0))


def warm_up(url: str, model: str, api_key: str | None, attempts: int = 20) -> None:
    """Two requests per route; a remote route may be refused until the scheduler has probed the link."""
    for _, policy in ROUTES:
        done = 0
        for i in range(attempts):
            try:
                one(url, model, f"Warm-up {i} via {policy}.", policy, 2, api_key)
                done += 1
            except RuntimeError as exc:
                print(f"  warm-up {policy}: {exc}; retrying", file=sys.stderr)
                time.sleep(1.0)
            if done == 2:
                break
        else:
            raise RuntimeError(f"warm-up via {policy} did not succeed in {attempts} attempts")


def run_variant(run: Run, config: Path, offset: int, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="crossfill-obsbench-") as tmp_name:
        tmp = Path(tmp_name)
        doc = variant_doc(yaml.safe_load(config.read_text()), offset, run.variant, tmp)
        path = tmp / "cluster.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg = load_config(path)
        api_key = client_api_key(cfg)
        prompts = {"local": make_prompt(cfg, args.short_tokens), "remote": make_prompt(cfg, args.long_tokens)}
        started = time.monotonic()
        children = start_children(cfg, str(path))
        try:
            why = wait_ready(children, cfg.serving.startup_timeout_s, [False], probe_tls(cfg))
            if why:
                raise RuntimeError(f"cluster ({run.variant}) did not start: {why}")
            time.sleep(2 * cfg.serving.health_check_interval_ms / 1000 + 0.5)  # the scheduler sees everyone
            gw = cfg.topology.gateway
            url = f"http://{gw.host}:{gw.port}"
            print(f"[{run.variant}] ready after {time.monotonic() - started:.0f} s; measuring", file=sys.stderr)
            warm_up(url, cfg.model.api_name, api_key)
            measure(run, url, cfg.model.api_name, prompts, args.requests, args.concurrency, args.max_tokens, api_key)
        finally:
            stop_children(children)  # SIGTERM: every process writes out its spans
        run.spans += sum(len(f.read_text().splitlines()) for f in (tmp / "spans").glob("*.jsonl"))


def report(runs: dict[str, Run], args: argparse.Namespace) -> list[str]:
    med = {v: {"local TTFT ms": statistics.median(r.ttft_ms["local"]),
               "remote TTFT ms": statistics.median(r.ttft_ms["remote"]),
               "decode tok/s": statistics.median(r.decode_tps),
               f"tok/s at {args.concurrency} clients": statistics.median(r.aggregate_tps)}
           for v, r in runs.items()}
    cols = list(med["off"])
    header = f"{'':<10}" + "".join(f"{c:>22}" for c in cols)
    out = [header, "-" * len(header)]
    for v in VARIANTS:
        out.append(f"{v:<10}" + "".join(f"{med[v][c]:>22.1f}" for c in cols))
    out.append(f"{'on / off':<10}" + "".join(f"{med['on'][c] / med['off'][c]:>22.3f}" for c in cols))
    out.append("")
    out.append(f"samples per variant: {len(runs['off'].ttft_ms['local'])} local + {len(runs['off'].ttft_ms['remote'])} "
               f"remote TTFTs, {len(runs['off'].decode_tps)} decode rates, {len(runs['off'].aggregate_tps)} "
               f"concurrent runs; spans written with tracing on: {runs['on'].spans} (off: {runs['off'].spans})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("examples/two-dc.yaml"))
    p.add_argument("--requests", type=int, default=20, help="per phase (sequential, concurrent), per cluster run")
    p.add_argument("--rounds", type=int, default=2, help="cluster runs per variant, alternating off/on")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--port-offset", type=int, default=1300)
    args = p.parse_args()
    runs = {v: Run(v) for v in VARIANTS}
    started = time.monotonic()
    for _ in range(args.rounds):
        for v in VARIANTS:
            run_variant(runs[v], args.config, args.port_offset, args)
    print(f"{args.config}: metrics + tracing off vs on ({args.rounds} cluster runs each, alternating; "
          f"{time.monotonic() - started:.0f} s in all); medians; ignore_eos, max_tokens {args.max_tokens}; "
          f"local: {args.short_tokens}-token prompts, local_only; remote: {args.long_tokens}-token prompts, "
          "remote_required")
    print("\n".join(report(runs, args)))


if __name__ == "__main__":
    main()
