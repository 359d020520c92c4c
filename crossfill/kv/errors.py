"""Errors and refusal reasons of the KV transfer layer.

Every refusal on the data plane carries a `Reason`: it travels on the wire as a one-byte code,
names the counter that was incremented, and is what `TransferError.reason` holds, so a log line,
a metric and an exception about the same event all say the same word.
"""

from __future__ import annotations

from enum import IntEnum


class Reason(IntEnum):
    """Why a manifest, frame, commit or whole transfer was refused or failed."""

    OK = 0
    MALFORMED = 1  # bytes that do not parse (bad magic, bad JSON, short body)
    UNKNOWN_VERSION = 2  # wire format version this build does not speak
    UNKNOWN_CACHE_ID = 3  # nobody expects this cache_id (or it was already finished)
    EXPIRED = 4  # manifest expiry or receiver deadline has passed
    FINGERPRINT_MISMATCH = 5  # KV made by a different model (config/weights)
    TOKEN_DIGEST_MISMATCH = 6  # KV of a different prompt
    MANIFEST_MISMATCH = 7  # layers/codec/tenant differ from what the receiver expects
    UNKNOWN_LAYER = 8  # frame for a layer the manifest does not list
    TOKEN_RANGE = 9  # frame tokens outside the layer's range or not on a frame boundary
    OVERSIZED = 10  # a length field beyond what the manifest allows
    CHECKSUM = 11  # payload checksum mismatch (corruption)
    CODEC = 12  # codec differs from the manifest's or the payload does not decode
    COMMIT_DIGEST = 13  # commit digest does not match the frames received
    INCOMPLETE = 14  # commit before every frame arrived (the sender resends the missing ones)
    TIMEOUT = 15  # a deadline passed while waiting
    SINK_ERROR = 16  # the decode-side sink raised while importing a verified chunk
    ABORTED = 17  # the other side or the local caller gave up
    CONNECTION = 18  # could not connect / connection lost beyond the retry budget
    TENANT_MISMATCH = 19  # the manifest's tenant is not the one the receiver expects
    DUPLICATE = 20  # manifest for a cache_id that is already being received under another manifest
    NO_RESOURCES = 21  # the receiver could not get the memory the transfer needs (e.g. a TE region)
    TICKET = 22  # the manifest carries no transfer ticket that permits this cache id here (crossfill.security.tickets)

    @property
    def label(self) -> str:
        return self.name.lower()


class KVError(Exception):
    """Base class of the KV layer's errors."""


class CodecError(KVError):
    """A codec spec that does not parse, or a payload that does not decode."""


class WireError(KVError):
    """Bytes on the wire that violate the format; `reason` says which rule."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"{reason.label}: {message}")
        self.reason = reason
        self.message = message


class TransferError(KVError):
    """A transfer that did not complete; the receiver-side consumer must discard any KV it got."""

    def __init__(self, reason: Reason, message: str, cache_id: str | None = None) -> None:
        where = f" (cache_id {cache_id})" if cache_id else ""
        super().__init__(f"KV transfer failed{where}: {reason.label}: {message}")
        self.reason = reason
        self.message = message
        self.cache_id = cache_id
