"""`crossfill linkemu` as a user runs it: a real process proxying real connections."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(60)

CLI = [sys.executable, "-m", "crossfill.cli", "linkemu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_proxies_and_serves_control_api():
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        up_port = upstream.getsockname()[1]
        listen, control = _free_port(), _free_port()
        proc = subprocess.Popen(
            [*CLI, "--listen", f"127.0.0.1:{listen}", "--upstream", f"127.0.0.1:{up_port}", "--latency", "25ms",
             "--bandwidth", "100mbit", "--control", f"127.0.0.1:{control}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    status = httpx.get(f"http://127.0.0.1:{control}/link", timeout=1, trust_env=False).json()
                    break
                except httpx.TransportError:
                    assert proc.poll() is None, proc.stderr.read().decode()
                    assert time.monotonic() < deadline, "linkemu did not start"
                    time.sleep(0.1)
            assert status["settings"]["bandwidth"] == "100mbit"
            assert status["settings"]["latency_ms"] == pytest.approx(25)
            with socket.create_connection(("127.0.0.1", listen), timeout=5) as client:
                server, _ = upstream.accept()
                with server:
                    t0 = time.perf_counter()
                    client.sendall(b"hello")
                    server.settimeout(60)
                    assert server.recv(100) == b"hello"
                    assert time.perf_counter() - t0 >= 0.024
            assert (
                httpx.get(f"http://127.0.0.1:{control}/link", trust_env=False).json()["counters"]["up"][
                    "bytes_out"
                ]
                == 5
            )
            proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop, not a traceback
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0 and b"linkemu stopped" in err and b"Traceback" not in err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_cli_bad_unit_is_a_clear_error_not_a_traceback():
    out = subprocess.run(
        [*CLI, "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--latency", "20 fortnights"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2
    assert "duration '20 fortnights' is not understood" in out.stderr
    assert "Traceback" not in out.stderr
