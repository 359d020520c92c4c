"""What crossed an emulated link, byte for byte: the wiretap an attacker on the WAN would have.

The link emulator (crossfill.net.linkemu) records every chunk it carries into a `Capture` while
one is armed (`LinkEmulator.start_capture`, or `POST /capture` on its control API), one stream per
connection and direction, so a test can search what crossed for secrets (the prompt, the KV) and
prove that mutual TLS leaves none of them readable. Memory-bounded: past `max_bytes` it stops
recording and says so (`truncated`), so an armed capture never grows without limit.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class Capture:
    max_bytes: int = DEFAULT_MAX_BYTES
    streams: dict[tuple[int, str], bytearray] = field(default_factory=dict)  # (connection, direction)
    captured_bytes: int = 0
    truncated: bool = False

    def record(self, connection: int, direction: str, data: bytes) -> None:
        room = self.max_bytes - self.captured_bytes
        if len(data) > room:
            data, self.truncated = data[:room], True
        if data:
            self.streams.setdefault((connection, direction), bytearray()).extend(data)
            self.captured_bytes += len(data)

    def as_json(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes, "captured_bytes": self.captured_bytes, "truncated": self.truncated,
                "streams": [{"connection": conn, "direction": d, "bytes": len(buf),
                             "data_b64": base64.b64encode(bytes(buf)).decode()}
                            for (conn, d), buf in sorted(self.streams.items())]}


def decode_streams(body: dict[str, Any]) -> list[bytes]:
    """The streams of a `GET /capture` answer, as bytes (one per connection and direction)."""
    return [base64.b64decode(s["data_b64"]) for s in body["streams"]]
