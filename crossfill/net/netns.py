"""Two datacenters as Linux network namespaces joined by a kernel-shaped veth link.

A rehearsal of a multi-host deployment on one machine: each datacenter gets its own network
namespace (its own interfaces, addresses and ports) and the two are joined by one veth pair, both
ends shaped with `tc` — an HTB class for the rate, and `netem` for the one-way delay where the
kernel has sch_netem (where it does not, only the rate is shaped and `WanLink.describe()` says
so). Unlike the user-space link emulator (`crossfill.net.linkemu`), the bytes cross real kernel
interfaces, so a config whose link says `emulate: false` runs unchanged, every process bound to
its namespace's address. Needs root and iproute2; `unavailable_reason()` says why not before
anything is created.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_HTB_MINOR = "10"  # the one shaped class, 1:10; unclassified traffic goes to it ("default")


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed; the message has the command and what it printed."""


@dataclass(frozen=True)
class WanLink:
    """The veth pair between two namespaces and how the kernel shapes it (both directions)."""

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    ifname: str  # the same name at both ends, each in its own namespace
    rate_mbit: float
    delay_ms: float
    netem_missing: str | None  # why the delay is not applied (tc's own words), None when it is

    def describe(self) -> str:
        ends = f"{self.namespaces[0]} {self.addresses[0]} <-> {self.namespaces[1]} {self.addresses[1]}"
        if self.delay_ms <= 0:
            return f"{ends}: veth {self.ifname}, tc htb {self.rate_mbit:g} Mbit/s, no added delay"
        if self.netem_missing is None:
            return f"{ends}: veth {self.ifname}, tc htb {self.rate_mbit:g} Mbit/s + netem {self.delay_ms:g} ms one way"
        return (f"{ends}: veth {self.ifname}, tc htb {self.rate_mbit:g} Mbit/s only — no netem in this kernel "
                f"({self.netem_missing}), so the {self.delay_ms:g} ms delay is not applied")


def _run(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed (status {r.returncode}): {r.stderr.strip()}")
    return r.stdout


def exec_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    """`argv` run inside `namespace`; `ip netns exec` execs it, so the pid is the program's own."""
    return ["ip", "netns", "exec", namespace, *argv]


def unavailable_reason() -> str | None:
    """Why namespaces, veth pairs and HTB cannot be set up here, or None when they can (probed)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (platform {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"cf-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except NetnsError as exc:
        return str(exc)
    try:
        _run("ip", "-n", probe, "link", "add", "cfp0", "type", "veth", "peer", "name", "cfp1")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "cfp0", "root", "handle", "1:", "htb")
    except NetnsError as exc:
        return str(exc)
    finally:
        _delete(probe)
    return None


def _delete(namespace: str) -> None:
    # Deleting a namespace destroys the veth end inside it, and with it the peer.
    r = subprocess.run(["ip", "netns", "del", namespace], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        log.error("could not delete network namespace %s: %s", namespace, r.stderr.strip())


def _shape(namespace: str, ifname: str, rate_mbit: float, delay_ms: float) -> str | None:
    """Rate-limit `ifname`'s egress, then delay it with netem; the reason netem is missing, or None."""
    rate = f"{rate_mbit:g}mbit"
    tc = ("tc", "-n", namespace)
    _run(*tc, "qdisc", "add", "dev", ifname, "root", "handle", "1:", "htb", "default", _HTB_MINOR)
    # An explicit quantum: the default (rate / r2q) is far above what HTB accepts without a warning.
    _run(*tc, "class", "add", "dev", ifname, "parent", "1:", "classid", f"1:{_HTB_MINOR}", "htb", "rate", rate,
         "ceil", rate, "quantum", "60000")
    if delay_ms <= 0:
        return None
    try:
        _run(*tc, "qdisc", "add", "dev", ifname, "parent", f"1:{_HTB_MINOR}", "handle", "10:", "netem", "delay",
             f"{delay_ms:g}ms")
    except NetnsError as exc:
        # Kernels built without sch_netem answer "Specified qdisc kind is unknown": shape the rate only.
        if "unknown" not in str(exc).lower():
            raise
        return str(exc).rsplit(": ", 1)[-1]
    return None


@contextmanager
def joined_namespaces(names: tuple[str, str], addresses: tuple[str, str], *, rate_mbit: float, delay_ms: float,
                      prefix_len: int = 24, ifname: str = "wan0") -> Iterator[WanLink]:
    """Create two namespaces joined by a shaped veth pair; delete both (and the pair) on exit."""
    created: list[str] = []
    try:
        for ns in names:
            _run("ip", "netns", "add", ns)
            created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        # Both ends are created directly inside their namespaces: nothing appears in the host's.
        _run("ip", "-n", names[0], "link", "add", ifname, "type", "veth", "peer", "name", ifname, "netns", names[1])
        missing: str | None = None
        for ns, address in zip(names, addresses, strict=True):
            _run("ip", "-n", ns, "addr", "add", f"{address}/{prefix_len}", "dev", ifname)
            _run("ip", "-n", ns, "link", "set", ifname, "up")
            missing = _shape(ns, ifname, rate_mbit, delay_ms) or missing
        yield WanLink(names, addresses, ifname, rate_mbit, delay_ms, missing)
    finally:
        for ns in reversed(created):
            _delete(ns)


def interface_bytes(namespace: str, ifname: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of `ifname` in `namespace`, from the kernel's counters."""
    stats = json.loads(_run("ip", "-n", namespace, "-j", "-s", "link", "show", "dev", ifname))[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def shaped_bytes(namespace: str, ifname: str) -> int:
    """Bytes that left `ifname` through its root HTB qdisc (so: through the rate limit)."""
    qdiscs = json.loads(_run("tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", ifname))
    return sum(int(q["bytes"]) for q in qdiscs if q.get("root") and q.get("kind") == "htb")


def enter(namespace: str) -> None:
    """Move the calling thread (only it: network namespaces are per thread) into `namespace`."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        setns = getattr(os, "setns", None)  # Python 3.12+
        if setns is not None:
            setns(fd, _CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def thread_in(namespace: str) -> ThreadPoolExecutor:
    """One worker thread living in `namespace`: sockets made by what is submitted to it are there."""
    return ThreadPoolExecutor(max_workers=1, initializer=enter, initargs=(namespace,),
                              thread_name_prefix=f"netns-{namespace}")
