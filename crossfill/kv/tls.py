"""SSL contexts for the KV data plane: mutual TLS from certificate, key and CA file paths.

KV holds user context, so the data plane authenticates both ends (M5.9): the receiver requires a
client certificate signed by the CA, and the sender verifies the receiver's certificate.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from crossfill.kv.errors import KVError


class TLSConfigError(KVError):
    """A certificate, key or CA path that is missing or unusable."""


def _check(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise TLSConfigError(f"{what} file {str(p)!r} does not exist; pass the path of a PEM file")
    return str(p)


def server_context(cert: str | Path, key: str | Path, ca: str | Path | None = None) -> ssl.SSLContext:
    """Context for KVReceiver; with `ca`, clients must present a certificate signed by it (mTLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(_check(cert, "certificate"), _check(key, "private key"))
        if ca is not None:
            ctx.load_verify_locations(_check(ca, "CA"))
            ctx.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as exc:
        raise TLSConfigError(f"cannot load TLS material ({cert}, {key}, {ca}): {exc}") from exc
    return ctx


def client_context(ca: str | Path, cert: str | Path | None = None, key: str | Path | None = None) -> ssl.SSLContext:
    """Context for KVSender: verifies the receiver against `ca`, presents `cert`/`key` for mTLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(_check(ca, "CA"))
        if cert is not None:
            if key is None:
                raise TLSConfigError("a client certificate needs its private key (key=...)")
            ctx.load_cert_chain(_check(cert, "certificate"), _check(key, "private key"))
    except ssl.SSLError as exc:
        raise TLSConfigError(f"cannot load TLS material ({ca}, {cert}, {key}): {exc}") from exc
    return ctx


def write_dev_pki(directory: str | Path, server_ip: str = "127.0.0.1") -> dict[str, Path]:
    """A throw-away CA, a server certificate for `server_ip` and a client certificate.

    For tests, benchmarks and `kv_cache.tls` demos; a deployment's certificates come from
    `crossfill certs init` (crossfill.security.pki). Returns paths keyed ca, server_cert,
    server_key, client_cert, client_key.
    """
    from crossfill.security.pki import write_dev_pki as write  # cryptography only when asked for

    return write(directory, server_ip)
