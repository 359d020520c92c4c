"""KV transfer layer: wire format, codecs, verification and transfer backends.

The names a worker needs (it never imports a backend class; `crossfill.kv.transports` builds one
by transport name):

    from crossfill.kv import Expectation, Manifest, TransferError, token_digest
    from crossfill.kv.transports import make_receiver, make_sender

Prefill side: `Manifest.build(...)`, then `async with make_sender(...).open(manifest) as tx`,
`await tx.send(chunk)` per layer, `stats = await tx.commit()`.
Decode side: `rx = await make_receiver(...).start()`, `rx.expect(Expectation(cache_id, sink,
fingerprint=..., token_digest=..., tenant=...))`, then `await rx.wait(cache_id)`; a TransferError
means: discard what the sink received.
"""

from crossfill.kv.assembler import Expectation, Sink
from crossfill.kv.backend import OutgoingTransfer, ReceiveBackend, TransferBackend, TransferStats
from crossfill.kv.codecs import CodecSpec, decode_kv, encode_kv, parse_codec, resolve_compression
from crossfill.kv.errors import CodecError, KVError, Reason, TransferError, WireError
from crossfill.kv.tcp import KVReceiver, KVSender
from crossfill.kv.wire import FORMAT_VERSION, LayerEntry, Manifest, token_digest

__all__ = [
    "FORMAT_VERSION", "CodecError", "CodecSpec", "Expectation", "KVError", "KVReceiver", "KVSender",
    "LayerEntry", "Manifest", "OutgoingTransfer", "Reason", "ReceiveBackend", "Sink", "TransferBackend",
    "TransferError", "TransferStats", "WireError", "decode_kv", "encode_kv", "parse_codec",
    "resolve_compression", "token_digest",
]
