"""Unit parsing for the link emulator's CLI and control API."""

from __future__ import annotations

import pytest

from crossfill.net.units import (
    UnitError,
    format_bandwidth,
    parse_bandwidth,
    parse_duration,
    parse_hostport,
    parse_loss,
)


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 1e9),
        ("100mbit", 1e8),
        ("100Mbit", 1e8),
        ("500kbit", 5e5),
        ("12.5MB/s", 1e8),
        ("8000", 8e3),
        (2e6, 2e6),
    ],
)
def test_bandwidth(text, bps):
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("100mbps", "ambiguous"),
        ("fast", "not understood"),
        ("0gbit", "greater than 0"),
        ("-5mbit", "not understood"),
    ],
)
def test_bandwidth_errors(text, match):
    with pytest.raises(UnitError, match=match):
        parse_bandwidth(text)


def test_durations_and_loss():
    assert parse_duration("20ms") == pytest.approx(0.020)
    assert parse_duration("1.5s") == pytest.approx(1.5)
    assert parse_duration("250us") == pytest.approx(250e-6)
    assert parse_duration("7") == pytest.approx(0.007)  # a bare number is ms, as in tc netem
    assert parse_duration(7) == pytest.approx(0.007)
    assert parse_loss("0.1%") == pytest.approx(0.001)
    assert parse_loss(0.02) == pytest.approx(0.02)
    with pytest.raises(UnitError, match="duration '20 min'"):
        parse_duration("20 min")
    with pytest.raises(UnitError, match="below 100%"):
        parse_loss("100%")
    with pytest.raises(UnitError, match="percentage"):
        parse_loss("lots")


def test_hostport_and_format():
    assert parse_hostport("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_hostport("[::1]:0") == ("::1", 0)
    with pytest.raises(UnitError, match="listen '127.0.0.1' is not HOST:PORT"):
        parse_hostport("127.0.0.1", "listen")
    assert format_bandwidth(1e9) == "1gbit" and format_bandwidth(None) == "unlimited"
