"""End-to-end TTFT with each security protection, side by side with the plaintext path.

    .venv/bin/python bench/security_ttft.py [--config examples/two-dc.yaml] [--repeats 7] [--long-tokens 1024]
                                            [--links emulated,loopback] [--variants plain,tls,tls+tickets,all]

Starts the example cluster (the `crossfill up` code path, ports shifted by --port-offset so a running
`make serve` is not disturbed) once per variant and link, one after the other, each with its own
temporary `security.dir` and `security.audit_dir`: "plain" (TLS, tickets, KV encryption and API keys
off: the path before issue 12), "tls" (mutual TLS between services and on the KV data plane only),
"tls+tickets" (and signed transfer tickets) and "all (default)" (the config's defaults: API keys on,
sent as the example's dev key). Link "emulated" is the config's WAN emulator (1 Gbit/s, 20 ms one
way in examples/two-dc.yaml); "loopback" sets the link's `emulate: false`, so KV and HTTP go straight
over 127.0.0.1. Each cluster gets a warm-up, then --repeats short local requests (local_only,
--short-tokens) and --repeats long remote ones (remote_required, --long-tokens), alternating, each
with its own first sentence so no prefix cache hits. Prints median TTFT per variant and link and its
ratio to "plain" on the same link: as the client sees it (a max_tokens 1 request, so the answer is
the first token, API-key check included) and as the gateway's route report measures it (from the
request's admission, after the key check).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from shifted import shift_ports  # bench/shifted.py (scripts run from bench/ on sys.path)

from crossfill.config import load_config
from crossfill.security.keys import client_api_key
from crossfill.serving.measure import make_prompt, one
from crossfill.serving.up import probe_tls, start_children, stop_children, wait_ready

# Switches each variant sets in `security`; None leaves the config's own values (the defaults).
VARIANTS: dict[str, dict[str, bool] | None] = {
    "plain": {"tls": False, "tickets": False, "kv_encryption": False, "auth": False},
    "tls": {"tls": True, "tickets": False, "kv_encryption": False, "auth": False},
    "tls+tickets": {"tls": True, "tickets": True, "kv_encryption": False, "auth": False},
    "all (default)": None,
}
SHORT_NAMES = {"plain": "plain", "tls": "tls", "tls+tickets": "tls+tickets", "all": "all (default)"}
LINKS = ("emulated", "loopback")


@dataclass
class Sample:
    """One request: TTFT seen by the client and by the gateway, in ms."""

    client_ms: float
    gateway_ms: float
    prompt_tokens: int


@dataclass
class Result:
    variant: str
    link: str
    local: list[Sample]
    remote: list[Sample]


def variant_doc(doc: dict[str, Any], offset: int, variant: str, emulate: bool, tmp: Path) -> dict[str, Any]:
    """The config of one run: ports shifted, the variant's switches, secrets and audit logs under `tmp`."""
    shift_ports(doc, offset)
    for link in doc["topology"].get("links", []):
        link["emulate"] = emulate
    sec = doc.setdefault("security", {})
    # Fresh secrets per run: a CA left by another variant (or by `make serve`) must not be reused.
    sec["dir"] = str(tmp / "security")
    sec["audit_dir"] = str(tmp / "audit")
    switches = VARIANTS[variant]
    if switches is not None:
        for name, on in switches.items():
            sec.setdefault(name, {})["enabled"] = on
    return doc


def timed(url: str, model: str, prompt: str, policy: str, api_key: str | None) -> Sample:
    t0 = time.perf_counter()
    info = one(url, model, prompt, policy, 1, api_key)  # max_tokens 1: the complete answer is the first token
    client_ms = (time.perf_counter() - t0) * 1000
    return Sample(client_ms, float(info["timings_ms"]["first_token"]), int(info["prompt_tokens"]))


def warm_up(url: str, model: str, api_key: str | None, attempts: int = 20) -> None:
    """A couple of requests per route; a remote route may be refused until the scheduler has probed the link."""
    for policy in ("local_only", "remote_required"):
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


def run(config: Path, offset: int, variant: str, link: str, repeats: int, short_tokens: int,
        long_tokens: int) -> Result:
    with tempfile.TemporaryDirectory(prefix="crossfill-secttft-") as tmp_name:
        tmp = Path(tmp_name)
        doc = variant_doc(yaml.safe_load(config.read_text()), offset, variant, link == "emulated", tmp)
        path = tmp / "cluster.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg = load_config(path)
        api_key = client_api_key(cfg)  # None when auth is off
        short, long = make_prompt(cfg, short_tokens), make_prompt(cfg, long_tokens)
        started = time.monotonic()
        children = start_children(cfg, str(path))
        try:
            why = wait_ready(children, cfg.serving.startup_timeout_s, [False], probe_tls(cfg))
            if why:
                raise RuntimeError(f"cluster ({variant}, {link}) did not start: {why}")
            # As measure-ttft: let the scheduler's health checks see every instance first.
            time.sleep(2 * cfg.serving.health_check_interval_ms / 1000 + 0.5)
            gw = cfg.topology.gateway
            url, model = f"http://{gw.host}:{gw.port}", cfg.model.api_name
            print(f"[{variant}, {link}] ready after {time.monotonic() - started:.0f} s; measuring", file=sys.stderr)
            warm_up(url, model, api_key)
            result = Result(variant, link, [], [])
            for i in range(repeats):
                # Alternating, so load that drifts during the run hits both routes alike; a distinct
                # first sentence per request, so neither the prefix cache nor decode-prefix reuse hits.
                result.local.append(timed(url, model, f"Request {i} of {variant} via local_only. {short}",
                                          "local_only", api_key))
                result.remote.append(timed(url, model, f"Request {i} of {variant} via remote_required. {long}",
                                           "remote_required", api_key))
            return result
        finally:
            stop_children(children)


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def report(results: list[Result], repeats: int) -> list[str]:
    first = results[0]
    out = [f"median of {repeats} requests per cell; local: {first.local[0].prompt_tokens} prompt tokens, "
           f"local_only; remote: {first.remote[0].prompt_tokens} prompt tokens, remote_required; "
           "x: ratio to plain on the same link",
           "client: max_tokens 1 request as the client times it (API-key check included); "
           "gateway: route report's first_token (from admission)", ""]
    header = (f"{'variant':<14} {'link':<9} {'local client':>12} {'x':>5} {'remote client':>13} {'x':>5} "
              f"{'local gw':>9} {'x':>5} {'remote gw':>9} {'x':>5}")
    out += [header, "-" * len(header)]
    plain = {r.link: r for r in results if r.variant == "plain"}
    for r in results:
        cells = []
        base = plain.get(r.link)
        for route, field, width in (("local", "client_ms", 12), ("remote", "client_ms", 13),
                                    ("local", "gateway_ms", 9), ("remote", "gateway_ms", 9)):
            m = median(getattr(r, route), field)
            ratio = f"{m / median(getattr(base, route), field):.2f}" if base is not None else ""
            cells.append(f"{m:>{width - 2}.0f}ms {ratio:>5}")
        out.append(f"{r.variant:<14} {r.link:<9} " + " ".join(cells))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("examples/two-dc.yaml"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--links", default=",".join(LINKS), help="comma-separated: emulated, loopback")
    p.add_argument("--variants", default=",".join(SHORT_NAMES), help="comma-separated: plain, tls, tls+tickets, all")
    p.add_argument("--port-offset", type=int, default=3000)
    args = p.parse_args()
    links = [s.strip() for s in args.links.split(",") if s.strip()]
    variants = [SHORT_NAMES.get(s.strip(), s.strip()) for s in args.variants.split(",") if s.strip()]
    bad = [x for x in links if x not in LINKS] + [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown link or variant: {', '.join(bad)}")
    started = time.monotonic()
    results = [run(args.config, args.port_offset, v, lk, args.repeats, args.short_tokens, args.long_tokens)
               for lk in links for v in variants]
    print(f"{args.config}: TTFT per security variant ({time.monotonic() - started:.0f} s in all)")
    print("\n".join(report(results, args.repeats)))


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, httpx.HTTPError) as exc:
        sys.exit(f"security_ttft: {exc}")
