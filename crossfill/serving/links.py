"""The WAN between datacenters on one machine: one LinkEmulator per crossing endpoint, one process.

`crossfill up` runs `python -m crossfill.serving.links CONFIG`; each emulator listens where the
config's `crossings()` say (decode's KV port as seen from a remote DC, a remote prefill's HTTP port
as seen from the local DC) with the link's bandwidth/latency/jitter/loss, and serves its fault
control API (`GET/POST /link`, `POST /faults`) on its control port.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from crossfill.config import CrossfillConfig, load_config


async def run_links(cfg: CrossfillConfig, stop: asyncio.Event) -> None:
    from crossfill.net.linkemu import LinkEmulator

    emus = []
    for c in cfg.crossings():
        link = cfg.topology.links[c.link_index]
        emu = LinkEmulator((c.target_host, c.target_port), (c.listen_host, c.listen_port),
                           bandwidth=link.bandwidth_gbps * 1e9, latency=link.latency_ms, jitter=link.jitter_ms,
                           loss=link.loss_pct / 100, control=(c.listen_host, c.control_port))
        await emu.start()
        emus.append(emu)
        logging.getLogger("crossfill.links").info(
            "link %s<->%s: %s:%d -> %s %s (%s:%d), %g Gbit/s, %g ms, control :%d", *link.between, c.listen_host,
            c.listen_port, c.target, c.kind, c.target_host, c.target_port, link.bandwidth_gbps, link.latency_ms,
            c.control_port)
    try:
        await stop.wait()
    finally:
        for emu in emus:
            await emu.stop()


def main(argv: list[str]) -> int:
    cfg = load_config(argv[0])
    logging.basicConfig(level=cfg.inference_service.observability.log_level.upper(),
                        format="%(asctime)s %(levelname)s [links] %(name)s: %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_links(cfg, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
