"""What a signed transfer ticket costs on the request path, next to the round trip it rides on.

    .venv/bin/python bench/tickets.py [--runs 7] [--n 2000] [--rtt-ms 40]

Per request the scheduler signs one ticket and prefill and decode verify it (the job, the
manifest): one sign and three verifies, HMAC-SHA256 over ~350 bytes of JSON plus the replay
cache. Prints the median microseconds per request and its share of one WAN round trip (the
decode -> prefill call every remote prefill already pays).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from crossfill.security.paths import TICKET_KEYS, ensure_symmetric_keys
from crossfill.security.tickets import TicketKeys, TicketSigner, TicketVerifier


def one_run(directory: Path, n: int, run: int) -> float:
    """Microseconds per request: one sign, three verifies (prefill's job, decode's job, decode's manifest)."""
    signer = TicketSigner(TicketKeys(directory / TICKET_KEYS), 120.0)
    verifiers = [TicketVerifier(TicketKeys(directory / TICKET_KEYS), 1) for _ in range(3)]
    start = time.perf_counter()
    for i in range(n):
        rid = f"r{run}-{i}"
        token = signer.sign(request_id=rid, tenant="acme", decode="here-decode-0",
                            prefills=("far-prefill-0", "here-prefill-0"))
        for v in verifiers:
            v.verify(token, tenant="acme", decode="here-decode-0", prefill="far-prefill-0", cache_id=f"{rid}.a")
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n", type=int, default=2000, help="requests per run")
    ap.add_argument("--rtt-ms", type=float, default=40.0, help="the WAN round trip to compare with")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ensure_symmetric_keys(Path(d))
        runs = [one_run(Path(d), args.n, r) for r in range(args.runs)]
    med = statistics.median(runs)
    print(f"tickets: sign + 3 verifies per request: median {med:.1f} us over {args.runs} runs "
          f"(min {min(runs):.1f}, max {max(runs):.1f})")
    print(f"ratio to one {args.rtt_ms:g} ms WAN round trip: {med / (args.rtt_ms * 1000):.5f}")


if __name__ == "__main__":
    main()
