"""Parsing of the human units used on the command line and in the link control API.

Bandwidth is in bits per second with tc-style suffixes (`1gbit`, `100mbit`, `500kbit`, `800bit`)
or bytes per second (`125MB/s`); `mbps`-style units are refused as ambiguous (tc reads them as
bytes, people as bits); durations take `us`, `ms`, `s`
(a bare number means milliseconds, as `tc netem delay 20` does); loss takes `0.1%` or a plain
fraction `0.001`. Each error names the text, what was expected and an example.
"""

from __future__ import annotations

import re

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BANDWIDTH_RE = re.compile(_NUMBER + r"\s*(?P<unit>[a-zA-Z/]*)$")

# multiplier to bits per second; bit units are case-insensitive, byte units need the capital B.
_BIT_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTE_UNITS = {"B/s": 8.0, "KB/s": 8e3, "kB/s": 8e3, "MB/s": 8e6, "GB/s": 8e9}
# tc reads "mbps" as megabytes/s while most people mean megabits/s: refuse rather than guess.
_AMBIGUOUS = {"bps", "kbps", "mbps", "gbps", "tbps", "b/s", "kb/s", "mb/s", "gb/s"}
_DURATION_UNITS = {"": 1e-3, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class UnitError(ValueError):
    """A value with a unit that could not be parsed; the message says what is accepted."""


def parse_bandwidth(text: str | float | int) -> float:
    """Return bits per second. Numbers are taken as bits per second already. 0 is refused."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _BANDWIDTH_RE.match(text.strip())
        unit = m.group("unit") if m else ""
        if m is not None and unit in _BYTE_UNITS:
            value = float(m.group("num")) * _BYTE_UNITS[unit]
        elif m is not None and unit.lower() in _BIT_UNITS:
            value = float(m.group("num")) * _BIT_UNITS[unit.lower()]
        elif m is not None and unit.lower() in _AMBIGUOUS:
            raise UnitError(
                f"bandwidth {text!r} is ambiguous (bits or bytes?): write e.g. '100mbit' for megabits/s "
                "or '12.5MB/s' for megabytes/s"
            )
        else:
            raise UnitError(
                f"bandwidth {text!r} is not understood: use a number with bit, kbit, mbit, gbit "
                "(bits/s) or B/s, KB/s, MB/s, GB/s (bytes/s), e.g. '1gbit'"
            )
    if not value > 0:
        raise UnitError(f"bandwidth {text!r} must be greater than 0 (omit it for an unlimited link)")
    return value


def parse_duration(text: str | float | int) -> float:
    """Return seconds. A bare number (str or not) is milliseconds, as in tc netem."""
    if isinstance(text, int | float):
        value = float(text) * 1e-3
    else:
        m = _BANDWIDTH_RE.match(text.strip())
        unit = m.group("unit").lower() if m else None
        if m is None or unit not in _DURATION_UNITS:
            raise UnitError(
                f"duration {text!r} is not understood: use a number with us, ms or s, e.g. '20ms'"
            )
        value = float(m.group("num")) * _DURATION_UNITS[unit]
    if value < 0:
        raise UnitError(f"duration {text!r} must not be negative")
    return value


def parse_loss(text: str | float | int) -> float:
    """Return a probability in [0, 1): '0.1%' -> 0.001; a bare number is a fraction (0.001)."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        s = text.strip()
        try:
            value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        except ValueError:
            raise UnitError(
                f"loss {text!r} is not understood: use a percentage like '0.1%' or a fraction like 0.001"
            ) from None
    if not 0 <= value < 1:
        raise UnitError(f"loss {text!r} must be at least 0 and below 100%")
    return value


def format_bandwidth(bps: float | None) -> str:
    """Human form of bits per second (`None` = unlimited), for logs and the control API."""
    if bps is None:
        return "unlimited"
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= mult:
            return f"{bps / mult:g}{unit}"
    return f"{bps:g}bit"


def parse_hostport(text: str, what: str = "address") -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port), with an error naming `what` when malformed."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UnitError(f"{what} {text!r} is not HOST:PORT (e.g. '127.0.0.1:9000'; port 0 picks a free one)")
    return host, int(port)
