"""KV wire format v1: manifest, frames, commit, and the receiver's answers.

The byte layout is documented in docs/KV_WIRE_FORMAT.md; this module is its only implementation,
shared by every transfer backend (TCP streams, store objects), so a KV cache verifies the same way
whichever path it took.

Frames sit at fixed positions: layer L's token range [start, end) is cut every `frame_tokens`
tokens, and frames are numbered (`seq`) in manifest layer order.  A receiver therefore knows,
from the manifest alone, exactly which frames must arrive, their sizes and their order, and can
refuse anything else before decoding it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import torch
import xxhash

from crossfill.kv.codecs import max_encoded_size, parse_codec, raw_size
from crossfill.kv.errors import CodecError, Reason, WireError

FORMAT_VERSION = 1
MAGIC = b"CXKV"
MAX_MANIFEST_BYTES = 1 << 20
MAX_LAYERS = 4096
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_TOKENS = 1 << 24
MAX_ID_LEN = 256
MAX_TICKET_LEN = 4096  # a signed transfer ticket (crossfill.security.tickets)
MAX_TRACEPARENT_LEN = 256  # a W3C traceparent is 55 characters today; later versions may add fields
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
LAYER_KINDS = ("full", "sliding", "recurrent")


class MsgType(IntEnum):
    MANIFEST = 1
    FRAME = 2
    COMMIT = 3
    ABORT = 4
    FRAME_REF = 5  # a frame already placed in the receiver's memory (Mooncake TE): u64 offset, u32 length
    MANIFEST_ACK = 16
    FRAME_ACK = 17
    COMMIT_ACK = 18


# magic, version, type, reason (answers) or 0, body length, xxh32 of the preceding 12 bytes.
# The envelope has its own check so a corrupted length is caught at once instead of desynchronising
# the stream until a timeout.
ENVELOPE = struct.Struct("!4sBBHII")
# seq, layer, start, end, raw_len, payload_len, checksum, codec name length
FRAME_HEADER = struct.Struct("!IIIIQIQB")
# frame_count, digest, xxh3-64 of the preceding 20 bytes (a corrupted commit is resent, not fatal)
COMMIT_BODY = struct.Struct("!I16sQ")
# A MANIFEST body is xxh3-64 of the JSON, then the JSON.
MANIFEST_CHECK = struct.Struct("!Q")
# seq (frame answers) or 0, message length; then the message, then u32 missing seqs (commit answers)
ANSWER_HEAD = struct.Struct("!IH")


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise WireError(Reason.MANIFEST_MISMATCH, f"dtype {dtype} cannot travel; use one of {', '.join(DTYPES)}")


def token_digest(token_ids: Sequence[int]) -> str:
    """Digest of the prompt token ids: ties the KV to the exact prompt it was computed for."""
    return hashlib.sha256(np.asarray(list(token_ids), dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class LayerEntry:
    """One layer in the manifest: what it keeps, its shapes and the token range shipped."""

    index: int
    kind: str  # full | sliding | recurrent
    window: int | None
    num_kv_heads: int
    head_dim: int
    dtype: str
    start: int  # first absolute token shipped (for recurrent layers: state row)
    end: int
    frames: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """What a transfer will carry; sent first, verified before any frame is accepted."""

    cache_id: str
    request_id: str
    tenant: str
    fingerprint: str
    token_digest: str
    num_tokens: int
    codec: str
    frame_tokens: int
    expires_at: float  # unix seconds
    layers: tuple[LayerEntry, ...]
    version: int = FORMAT_VERSION
    frame_count: int = field(default=-1)
    # The scheduler's transfer ticket for this cache id (crossfill.security.tickets), which the
    # receiver checks before anything else; None when tickets are off. Optional, so a version-1
    # manifest without it still parses (and is refused by a receiver that requires tickets).
    ticket: str | None = None
    # The sender's span as a W3C traceparent (crossfill.observability.tracing), so the receiver's
    # spans join the request's trace; None when tracing is off. Optional, like `ticket`.
    traceparent: str | None = None

    def __post_init__(self) -> None:
        if self.frame_count == -1:
            object.__setattr__(self, "frame_count", sum(e.frames for e in self.layers))
        object.__setattr__(self, "_offsets", _offsets(self.layers))
        object.__setattr__(self, "_by_index", {e.index: i for i, e in enumerate(self.layers)})

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        *,
        cache_id: str,
        request_id: str,
        tenant: str,
        fingerprint: str,
        token_ids: Sequence[int],
        layer_specs: Sequence[Any],
        codec: str = "none",
        prune_windows: bool = False,
        skip_tokens: int = 0,
        frame_tokens: int | None = None,
        ttl_s: float = 60.0,
        ticket: str | None = None,
        traceparent: str | None = None,
    ) -> Manifest:
        """Manifest for shipping the KV of `token_ids` produced by layers `layer_specs`.

        `prune_windows` ships only the tokens a sliding layer still needs (LayerSpec.kept_tokens);
        `skip_tokens` leaves out a prefix the receiver already holds (its prefix cache).
        """
        n = len(token_ids)
        if frame_tokens is None:
            frame_tokens = auto_frame_tokens(layer_specs)
        entries = []
        for spec in layer_specs:
            start = n - spec.kept_tokens(n) if prune_windows else 0
            start = max(start, min(skip_tokens, n))
            entries.append(
                LayerEntry(
                    index=spec.index, kind=spec.kind, window=spec.window, num_kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim, dtype=dtype_name(spec.dtype), start=start, end=n,
                    frames=math.ceil((n - start) / frame_tokens),
                )
            )
        m = cls(
            cache_id=cache_id, request_id=request_id, tenant=tenant, fingerprint=fingerprint,
            token_digest=token_digest(token_ids), num_tokens=n, codec=str(parse_codec(codec)),
            frame_tokens=frame_tokens, expires_at=time.time() + ttl_s, layers=tuple(entries), ticket=ticket,
            traceparent=traceparent,
        )
        m.validate()
        return m

    # -- lookups --------------------------------------------------------------------------
    def layer(self, index: int) -> LayerEntry | None:
        pos = self._by_index.get(index)  # type: ignore[attr-defined]
        return None if pos is None else self.layers[pos]

    def seq_of(self, layer: int, start: int) -> int:
        pos = self._by_index[layer]  # type: ignore[attr-defined]
        entry = self.layers[pos]
        return self._offsets[pos] + (start - entry.start) // self.frame_tokens  # type: ignore[attr-defined]

    def slot(self, seq: int) -> tuple[LayerEntry, int, int]:
        """(layer, start, end) of frame `seq`."""
        if not 0 <= seq < self.frame_count:
            raise WireError(Reason.TOKEN_RANGE, f"frame seq {seq} outside 0..{self.frame_count - 1}")
        offsets = self._offsets  # type: ignore[attr-defined]
        pos = int(np.searchsorted(offsets, seq, side="right")) - 1
        while self.layers[pos].frames == 0 or seq >= offsets[pos] + self.layers[pos].frames:
            pos += 1
        entry = self.layers[pos]
        start = entry.start + (seq - offsets[pos]) * self.frame_tokens
        return entry, start, min(start + self.frame_tokens, entry.end)

    def is_expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def raw_bytes(self) -> int:
        return sum(raw_size(e.end - e.start, e.num_kv_heads, e.head_dim, e.torch_dtype) for e in self.layers)

    # -- serialisation --------------------------------------------------------------------
    def to_json(self) -> bytes:
        d = asdict(self)
        d["layers"] = [asdict(e) for e in self.layers]
        if self.ticket is None:
            del d["ticket"]  # without tickets, the bytes are those of a manifest before they existed
        if self.traceparent is None:
            del d["traceparent"]  # likewise without tracing
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate; raises WireError(MALFORMED / UNKNOWN_VERSION / OVERSIZED ...)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise WireError(Reason.OVERSIZED, f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WireError(Reason.MALFORMED, f"manifest is not JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise WireError(Reason.MALFORMED, "manifest must be a JSON object")
        version = d.get("version")
        if version != FORMAT_VERSION:
            raise WireError(Reason.UNKNOWN_VERSION,
                            f"manifest version {version!r}; this receiver speaks {FORMAT_VERSION}")
        try:
            layers = tuple(LayerEntry(**e) for e in d.pop("layers"))
            m = cls(layers=layers, **d)
        except (TypeError, KeyError, AttributeError) as exc:
            raise WireError(Reason.MALFORMED, f"manifest fields: {exc}") from exc
        m.validate()
        return m

    def validate(self) -> None:
        """Check internal consistency; every bound here limits what a peer can make us allocate."""
        def bad(msg: str, reason: Reason = Reason.MALFORMED) -> WireError:
            return WireError(reason, f"manifest {msg}")

        for name in ("cache_id", "request_id", "tenant", "fingerprint", "token_digest", "codec"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > MAX_ID_LEN or (name == "cache_id" and not v):
                raise bad(f"field {name} must be a string of at most {MAX_ID_LEN} characters")
        try:
            parse_codec(self.codec)
        except CodecError as exc:
            raise bad(str(exc), Reason.CODEC) from exc
        if not _is_int(self.num_tokens) or not 0 <= self.num_tokens <= MAX_TOKENS:
            raise bad(f"num_tokens {self.num_tokens!r} outside 0..{MAX_TOKENS}", Reason.OVERSIZED)
        if not _is_int(self.frame_tokens) or not 1 <= self.frame_tokens <= MAX_TOKENS:
            raise bad(f"frame_tokens {self.frame_tokens!r} outside 1..{MAX_TOKENS}")
        if not isinstance(self.expires_at, int | float) or isinstance(self.expires_at, bool):
            raise bad("expires_at must be unix seconds")
        if self.ticket is not None and (not isinstance(self.ticket, str) or len(self.ticket) > MAX_TICKET_LEN):
            raise bad(f"field ticket must be a string of at most {MAX_TICKET_LEN} characters")
        if self.traceparent is not None and (not isinstance(self.traceparent, str)
                                             or len(self.traceparent) > MAX_TRACEPARENT_LEN):
            raise bad(f"field traceparent must be a string of at most {MAX_TRACEPARENT_LEN} characters")
        if len(self.layers) > MAX_LAYERS:
            raise bad(f"has {len(self.layers)} layers, at most {MAX_LAYERS}", Reason.OVERSIZED)
        seen = set()
        for e in self.layers:
            where = f"layer {e.index!r}"
            if not _is_int(e.index) or e.index < 0 or e.index in seen:
                raise bad(f"{where}: index must be a unique non-negative integer")
            seen.add(e.index)
            if e.kind not in LAYER_KINDS:
                raise bad(f"{where}: kind {e.kind!r} not one of {LAYER_KINDS}")
            if e.window is not None and (not _is_int(e.window) or e.window < 1):
                raise bad(f"{where}: window {e.window!r} must be a positive integer or null")
            if e.dtype not in DTYPES:
                raise bad(f"{where}: dtype {e.dtype!r} not one of {', '.join(DTYPES)}")
            if not (_is_int(e.num_kv_heads) and 1 <= e.num_kv_heads <= MAX_HEADS
                    and _is_int(e.head_dim) and 1 <= e.head_dim <= MAX_HEAD_DIM):
                raise bad(f"{where}: shapes ({e.num_kv_heads!r}, {e.head_dim!r}) out of bounds", Reason.OVERSIZED)
            limit = MAX_TOKENS if e.kind == "recurrent" else self.num_tokens
            if not (_is_int(e.start) and _is_int(e.end) and 0 <= e.start <= e.end <= limit):
                raise bad(f"{where}: token range [{e.start!r}, {e.end!r}) outside [0, {limit}]", Reason.TOKEN_RANGE)
            if e.frames != math.ceil((e.end - e.start) / self.frame_tokens):
                raise bad(f"{where}: {e.frames!r} frames, its range and frame_tokens need "
                          f"{math.ceil((e.end - e.start) / self.frame_tokens)}")
        if self.frame_count != sum(e.frames for e in self.layers):
            raise bad(f"frame_count {self.frame_count!r} differs from the layers' sum")


TARGET_FRAME_BYTES = 1 << 20


def auto_frame_tokens(layer_specs: Sequence[Any]) -> int:
    """Tokens per frame so the widest layer's frames hold about 1 MiB of raw KV.

    Per-frame costs (an answer, a checksum call, a sink call) are fixed, so frames should be
    large; but not so large that a retransmission or the last layer's tail costs much.  Power of
    two between 16 and 4096.
    """
    widest = max((s.bytes_per_token for s in layer_specs), default=1)
    tokens = max(16, min(4096, TARGET_FRAME_BYTES // max(1, widest)))
    return 1 << (tokens.bit_length() - 1)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _offsets(layers: Sequence[LayerEntry]) -> list[int]:
    out, acc = [], 0
    for e in layers:
        out.append(acc)
        acc += e.frames
    return out


# --- frames ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    """One encoded piece of one layer's KV.

    The payload may be several buffers (`parts`) so a sender can write K and V straight from the
    tensors it owns, without joining them into one copy first.
    """

    seq: int
    layer: int
    start: int
    end: int
    codec: str
    raw_len: int
    checksum: int
    parts: tuple[bytes | memoryview, ...]

    @property
    def payload_len(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)

    @property
    def payload(self) -> bytes | memoryview:
        """The payload as one buffer (no copy when it is a single part)."""
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    def header(self) -> bytes:
        """Frame header, codec name and the zero padding that 8-aligns the payload in the body."""
        codec = self.codec.encode()
        pad = _pad(len(codec))
        return FRAME_HEADER.pack(self.seq, self.layer, self.start, self.end, self.raw_len,
                                 self.payload_len, self.checksum, len(codec)) + codec + bytes(pad)

    @property
    def wire_len(self) -> int:
        return ENVELOPE.size + len(self.header()) + self.payload_len

    def to_bytes(self) -> bytes:
        return self.wire_header() + b"".join(self.parts)

    def body(self) -> bytes:
        """The FRAME body without its envelope (what a store object holds); parse with parse_frame."""
        return self.header() + b"".join(self.parts)

    def wire_header(self) -> bytes:
        """Envelope plus frame header: what precedes the payload on a stream."""
        h = self.header()
        return envelope(MsgType.FRAME, len(h) + self.payload_len) + h


def _pad(codec_len: int) -> int:
    """Zero bytes after the codec name so the payload starts 8-aligned: the receiver can view it in place."""
    return -(FRAME_HEADER.size + codec_len) % 8


def frame_checksum(seq: int, layer: int, start: int, end: int, raw_len: int, codec: str,
                   parts: Sequence[bytes | memoryview]) -> int:
    """xxh3-64 over the frame's identity fields and payload, so a flipped header bit is caught too."""
    h = xxhash.xxh3_64()
    h.update(struct.pack("!IIIIQ", seq, layer, start, end, raw_len) + codec.encode())
    for p in parts:
        h.update(p)
    return h.intdigest()


def make_frame(seq: int, layer: int, start: int, end: int, codec: str, raw_len: int,
               payload: bytes | memoryview | Sequence[bytes | memoryview]) -> Frame:
    parts = tuple(payload) if isinstance(payload, list | tuple) else (payload,)
    return Frame(seq, layer, start, end, codec, raw_len,
                 frame_checksum(seq, layer, start, end, raw_len, codec, parts), parts)


def parse_frame(body: bytes | bytearray | memoryview) -> Frame:
    """Parse a FRAME body (no envelope); checks only the framing, not the manifest.

    The payload is a view into `body`: pass a bytearray and the decoder can use it in place.
    """
    mv = memoryview(body)
    if len(mv) < FRAME_HEADER.size:
        raise WireError(Reason.MALFORMED, f"frame body of {len(mv)} bytes is shorter than its header")
    seq, layer, start, end, raw_len, payload_len, checksum, codec_len = FRAME_HEADER.unpack_from(mv)
    at = FRAME_HEADER.size + codec_len + _pad(codec_len)
    if at + payload_len != len(mv):
        raise WireError(Reason.MALFORMED, f"frame {seq}: declared lengths do not add up to the body size")
    codec_b = bytes(mv[FRAME_HEADER.size:FRAME_HEADER.size + codec_len])
    if any(mv[FRAME_HEADER.size + codec_len:at]):
        raise WireError(Reason.MALFORMED, f"frame {seq}: padding after the codec name is not zero")
    try:
        codec = codec_b.decode("ascii")
    except UnicodeDecodeError as exc:
        raise WireError(Reason.MALFORMED, f"frame {seq}: codec name is not ASCII") from exc
    return Frame(seq, layer, start, end, codec, raw_len, checksum, (mv[at:],))


def check_frame(manifest: Manifest, frame: Frame) -> LayerEntry:
    """Refuse a frame that is not exactly one the manifest announced, or whose checksum fails."""
    entry = manifest.layer(frame.layer)
    if entry is None:
        raise WireError(Reason.UNKNOWN_LAYER, f"frame {frame.seq}: layer {frame.layer} is not in the manifest")
    if not (entry.start <= frame.start < entry.end and (frame.start - entry.start) % manifest.frame_tokens == 0
            and frame.end == min(frame.start + manifest.frame_tokens, entry.end)):
        raise WireError(Reason.TOKEN_RANGE, f"frame {frame.seq}: tokens [{frame.start}, {frame.end}) are not a "
                        f"frame slot of layer {frame.layer} range [{entry.start}, {entry.end})")
    if manifest.seq_of(frame.layer, frame.start) != frame.seq:
        raise WireError(Reason.TOKEN_RANGE, f"frame {frame.seq}: sequence number does not match its slot")
    if frame.codec != manifest.codec:
        raise WireError(Reason.CODEC, f"frame {frame.seq}: codec {frame.codec!r}, manifest says {manifest.codec!r}")
    tokens = frame.end - frame.start
    expected_raw = raw_size(tokens, entry.num_kv_heads, entry.head_dim, entry.torch_dtype)
    if frame.raw_len != expected_raw:
        raise WireError(Reason.OVERSIZED, f"frame {frame.seq}: raw length {frame.raw_len}, shapes give {expected_raw}")
    limit = max_encoded_size(parse_codec(manifest.codec), tokens, entry.num_kv_heads, entry.head_dim,
                             entry.torch_dtype)
    if frame.payload_len > limit:
        raise WireError(Reason.OVERSIZED, f"frame {frame.seq}: payload {frame.payload_len} bytes > {limit}")
    actual = frame_checksum(frame.seq, frame.layer, frame.start, frame.end, frame.raw_len, frame.codec,
                            frame.parts)
    if actual != frame.checksum:
        raise WireError(Reason.CHECKSUM, f"frame {frame.seq}: checksum mismatch (corrupted in transit)")
    return entry


def max_frame_body(manifest: Manifest) -> int:
    """Largest FRAME body this manifest can legitimately produce: the read limit per message."""
    spec = parse_codec(manifest.codec)
    biggest = 0
    for e in manifest.layers:
        if e.frames:
            biggest = max(biggest, max_encoded_size(spec, min(manifest.frame_tokens, e.end - e.start),
                                                    e.num_kv_heads, e.head_dim, e.torch_dtype))
    return FRAME_HEADER.size + 255 + 8 + biggest


# --- commit ----------------------------------------------------------------------------------

def commit_digest(checksums: Sequence[int]) -> bytes:
    """xxh3-128 over every frame checksum in seq order."""
    return xxhash.xxh3_128(struct.pack(f"!{len(checksums)}Q", *checksums)).digest()


def commit_body(frame_count: int, digest: bytes) -> bytes:
    head = struct.pack("!I16s", frame_count, digest)
    return head + struct.pack("!Q", xxhash.xxh3_64_intdigest(head))


def parse_commit_body(body: bytes) -> tuple[int, bytes]:
    """(frame_count, digest) of a COMMIT body; WireError(MALFORMED/CHECKSUM) when it is damaged."""
    if len(body) != COMMIT_BODY.size:
        raise WireError(Reason.MALFORMED, f"commit body of {len(body)} bytes, expected {COMMIT_BODY.size}")
    count, digest, check = COMMIT_BODY.unpack(body)
    if xxhash.xxh3_64_intdigest(body[:-8]) != check:
        raise WireError(Reason.CHECKSUM, "commit checksum mismatch (corrupted in transit)")
    return count, digest


def manifest_body(m: Manifest) -> bytes:
    data = m.to_json()
    return MANIFEST_CHECK.pack(xxhash.xxh3_64_intdigest(data)) + data


def parse_manifest_body(body: bytes) -> Manifest:
    """Verify the MANIFEST body's checksum, then parse and validate the JSON."""
    if len(body) < MANIFEST_CHECK.size:
        raise WireError(Reason.MALFORMED, "manifest body shorter than its checksum")
    (check,) = MANIFEST_CHECK.unpack_from(body)
    data = body[MANIFEST_CHECK.size:]
    if xxhash.xxh3_64_intdigest(data) != check:
        raise WireError(Reason.CHECKSUM, "manifest checksum mismatch (corrupted in transit)")
    return Manifest.from_json(data)


# --- envelopes and answers -------------------------------------------------------------------

def envelope(kind: MsgType, body_len: int, reason: Reason = Reason.OK) -> bytes:
    head = struct.pack("!4sBBHI", MAGIC, FORMAT_VERSION, int(kind), int(reason), body_len)
    return head + struct.pack("!I", xxhash.xxh32_intdigest(head))


def message(kind: MsgType, body: bytes, reason: Reason = Reason.OK) -> bytes:
    return envelope(kind, len(body), reason) + body


def answer(kind: MsgType, reason: Reason, seq: int = 0, text: str = "", missing: Sequence[int] = ()) -> bytes:
    t = text.encode()[:4096]
    body = ANSWER_HEAD.pack(seq, len(t)) + t + struct.pack(f"!{len(missing)}I", *missing)
    return message(kind, body, reason)


@dataclass(frozen=True)
class Answer:
    kind: MsgType
    reason: Reason
    seq: int
    text: str
    missing: tuple[int, ...]


def parse_answer(kind: MsgType, reason_code: int, body: bytes) -> Answer:
    if len(body) < ANSWER_HEAD.size:
        raise WireError(Reason.MALFORMED, "answer shorter than its header")
    seq, tlen = ANSWER_HEAD.unpack_from(body)
    rest = body[ANSWER_HEAD.size + tlen:]
    if len(rest) % 4:
        raise WireError(Reason.MALFORMED, "answer's missing-frame list is not whole u32s")
    try:
        reason = Reason(reason_code)
    except ValueError:
        reason = Reason.MALFORMED
    missing = struct.unpack(f"!{len(rest) // 4}I", rest)
    text = body[ANSWER_HEAD.size:ANSWER_HEAD.size + tlen].decode(errors="replace")
    return Answer(kind, reason, seq, text, missing)


def parse_envelope(head: bytes, max_body: int) -> tuple[MsgType, int, int]:
    """Check one envelope header: (type, reason, body length), or a WireError naming what is wrong.

    The single place every reader (asyncio streams, the buffered stream parser) validates
    envelopes: bad magic, corrupted header, unknown versions/types and oversized bodies.
    """
    magic, version, kind, reason, body_len, check = ENVELOPE.unpack(head)
    if magic != MAGIC:
        raise WireError(Reason.MALFORMED, f"bad magic {magic!r}; not a crossfill KV stream")
    if xxhash.xxh32_intdigest(head[:-4]) != check:
        raise WireError(Reason.CHECKSUM, "message envelope checksum mismatch (corrupted in transit)")
    if version != FORMAT_VERSION:
        raise WireError(Reason.UNKNOWN_VERSION, f"wire version {version}; this build speaks {FORMAT_VERSION}")
    try:
        msg_type = MsgType(kind)
    except ValueError as exc:
        raise WireError(Reason.MALFORMED, f"unknown message type {kind}") from exc
    if body_len > max_body:
        raise WireError(Reason.OVERSIZED, f"{msg_type.name} body of {body_len} bytes exceeds the limit {max_body}")
    return msg_type, reason, body_len


async def read_message(reader: asyncio.StreamReader, max_body: int) -> tuple[MsgType, int, bytes]:
    """Read one envelope and its body; refuses bad magic, unknown versions/types and oversized bodies.

    Raises asyncio.IncompleteReadError at a clean or unclean end of stream.
    """
    head = await reader.readexactly(ENVELOPE.size)
    msg_type, reason, body_len = parse_envelope(head, max_body)
    body = await reader.readexactly(body_len)
    return msg_type, reason, body
