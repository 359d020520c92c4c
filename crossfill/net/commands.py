"""Sub-commands of the net package: `crossfill linkemu`."""

from __future__ import annotations

import asyncio
import logging
import signal

import typer

from crossfill.net.units import UnitError


def register(app: typer.Typer) -> None:
    @app.command()
    def linkemu(
        listen: str = typer.Option(..., help="HOST:PORT clients connect to (port 0 picks a free one)."),
        upstream: str = typer.Option(..., help="HOST:PORT the traffic is forwarded to."),
        bandwidth: str = typer.Option(None, help="Link rate per direction, e.g. 1gbit, 100mbit, 12.5MB/s."),
        latency: str = typer.Option("0ms", help="One-way delay, e.g. 20ms."),
        jitter: str = typer.Option("0ms", help="Uniform +/- variation of the one-way delay, e.g. 5ms."),
        loss: str = typer.Option("0%", help="Segment loss rate, e.g. 0.1% (shows up as retransmit delay)."),
        control: str = typer.Option(
            None, help="HOST:PORT of the HTTP control API (GET/POST /link, /faults)."
        ),
        seed: int = typer.Option(None, help="Seed of the jitter and loss draws, for repeatable runs."),
    ) -> None:
        """Emulate a WAN link: a TCP proxy with bandwidth, latency, jitter, loss and fault injection."""
        from crossfill.net.linkemu import LinkEmulator

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            emu = LinkEmulator(
                upstream,
                listen,
                bandwidth=bandwidth,
                latency=latency,
                jitter=jitter,
                loss=loss,
                control=control,
                seed=seed,
            )
        except UnitError as exc:
            raise typer.BadParameter(str(exc)) from None

        async def run() -> None:
            try:
                await emu.start()
            except OSError as exc:
                raise typer.BadParameter(f"cannot listen on {listen} / {control}: {exc}") from None
            where = f"listening on {emu.listen[0]}:{emu.listen_port}"
            if control:
                where += f", control on http://{emu.control[0]}:{emu.control_port}/link"
            typer.echo(f"linkemu {where} -> {upstream}", err=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            try:
                await stop.wait()
            finally:
                await emu.stop()
            typer.echo("linkemu stopped", err=True)

        asyncio.run(run())
