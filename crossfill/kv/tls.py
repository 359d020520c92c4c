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
    """Write a throw-away CA, a server certificate for `server_ip` and a client certificate.

    For tests, benchmarks and local demos only; production certificates come from the operator's
    PKI. Returns paths keyed ca, server_cert, server_key, client_cert, client_key.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
             ca: bool, ip: str | None) -> bytes:
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=7))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ip:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                                critical=False)
        return b.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    out = {"ca": d / "ca.pem"}
    out["ca"].write_bytes(cert("crossfill dev CA", ca_key, name("crossfill dev CA"), ca_key, True, None))
    for who, ip in (("server", server_ip), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        out[f"{who}_cert"] = d / f"{who}.pem"
        out[f"{who}_key"] = d / f"{who}.key"
        out[f"{who}_cert"].write_bytes(cert(f"crossfill {who}", key, name("crossfill dev CA"), ca_key, False, ip))
        out[f"{who}_key"].write_bytes(key_pem(key))
        out[f"{who}_key"].chmod(0o600)
    return out
