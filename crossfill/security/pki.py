"""The deployment's own small PKI: one CA and a certificate per service, for mutual TLS on every hop.

Every process of a deployment is both a TLS server (its HTTP port, decode's KV port) and a TLS
client (the gateway calls the scheduler and decode, decode calls prefill, prefill sends KV to
decode, the scheduler probes everyone), so every certificate carries both the serverAuth and the
clientAuth usage and a SAN for each address it is reached at: the service's host from the config
plus the loopback names (the WAN emulators of `crossfill up` and local tools reach services at
127.0.0.1). "operator" is a client certificate for people and tools (the admin CLI, tests,
`crossfill up`'s readiness probes).

Keys are ECDSA P-256; private keys are written 0600 (crossfill.security.paths.write_private). The
CA key is needed only to issue certificates: a multi-host deployment keeps it off the serving hosts.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from crossfill.config import ConfigError, CrossfillConfig
from crossfill.security import paths

CA_DAYS = 3650
CERT_DAYS = 365
LOOPBACK = ("127.0.0.1", "::1", "localhost")
_ORG = "crossfill"
# Clock skew between hosts: a certificate is valid from a little before it was made.
_BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Issuer:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(host: str) -> x509.GeneralName:
    """An IP SAN for an address (TLS clients compare IPs against IP SANs only), else a DNS SAN."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_ca(common_name: str = "crossfill CA", days: int = CA_DAYS) -> Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    return Issuer(cert, key)


def make_cert(issuer: Issuer, name: str, hosts: list[str], days: int = CERT_DAYS
              ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate for service `name`, valid for `hosts` and the loopback names, server and client."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = []
    for host in [*hosts, *LOOPBACK]:
        san = _san(host)
        if san not in sans:
            sans.append(san)
    ca_ski = issuer.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(issuer.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(issuer.key, hashes.SHA256()))
    return cert, key


# --------------------------------------------------------------------------- the security folder


def service_hosts(cfg: CrossfillConfig) -> dict[str, list[str]]:
    """Every service of the config that needs a certificate, with the hosts it is reached at."""
    out: dict[str, list[str]] = {inst.name: [inst.host] for inst in cfg.instances()}
    out[paths.OPERATOR] = []
    return out


def _write_ca(directory: Path) -> Issuer:
    ca = make_ca()
    paths.write_private(directory / paths.CA_KEY, _key_pem(ca.key))
    (directory / paths.CA_CERT).write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    return ca


def load_issuer(directory: Path) -> Issuer:
    """The CA that issues new certificates (the first certificate of ca.pem, and ca.key)."""
    ca_pem = directory / paths.CA_CERT
    key_file = directory / paths.CA_KEY
    cert = x509.load_pem_x509_certificate(paths.read_secret_file(ca_pem, "CA certificate"))
    key = serialization.load_pem_private_key(paths.read_secret_file(key_file, "CA private key"), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ConfigError(f"security.dir: {str(key_file)!r} is not the private key of {str(ca_pem)!r}")
    return Issuer(cert, key)


def write_cert(directory: Path, issuer: Issuer, name: str, hosts: list[str]) -> tuple[Path, Path]:
    cert, key = make_cert(issuer, name, hosts)
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
    paths.write_private(key_file, _key_pem(key))  # the key first: a cert without its key is useless
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_file, key_file


def init_security_dir(cfg: CrossfillConfig, directory: str | Path | None = None, force: bool = False) -> list[Path]:
    """Write what the folder lacks: the CA, a certificate per service, the symmetric keys.

    Existing files are kept (other hosts may hold copies), except with `force`, which makes a new
    CA and reissues every certificate. A new CA always reissues every certificate, since the old
    ones would not chain to it. Returns the paths written.
    """
    d = Path(directory).expanduser() if directory is not None else paths.security_dir(cfg)
    d.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    issuer: Issuer | None = None
    new_ca = force or not (d / paths.CA_CERT).exists()
    if new_ca:
        issuer = _write_ca(d)
        written += [d / paths.CA_CERT, d / paths.CA_KEY]
    for name, hosts in service_hosts(cfg).items():
        if not new_ca and (d / f"{name}.pem").exists() and (d / f"{name}.key").exists():
            continue
        issuer = issuer or load_issuer(d)
        written += write_cert(d, issuer, name, hosts)
    written += paths.ensure_symmetric_keys(d)
    return written


def issue(cfg_or_dir: CrossfillConfig | str | Path, name: str, hosts: list[str]) -> tuple[Path, Path]:
    """A certificate for one more service (an instance added at run time), signed by the folder's CA."""
    d = paths.security_dir(cfg_or_dir) if isinstance(cfg_or_dir, CrossfillConfig) else Path(cfg_or_dir).expanduser()
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"certs issue: {name!r} is not a service name")
    return write_cert(d, load_issuer(d), name, hosts)


# --------------------------------------------------------------------------- reading back


@dataclass(frozen=True)
class CertInfo:
    file: str
    subject: str
    issuer: str
    sans: list[str]
    not_after: datetime.datetime
    is_ca: bool


def read_certs(path: Path) -> list[CertInfo]:
    """Every certificate in a PEM file (a CA bundle holds several)."""
    out = []
    for cert in x509.load_pem_x509_certificates(path.read_bytes()):
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            sans = [str(v) for v in san.get_values_for_type(x509.DNSName)] + \
                   [str(v) for v in san.get_values_for_type(x509.IPAddress)]
        except x509.ExtensionNotFound:
            sans = []
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        out.append(CertInfo(path.name, cert.subject.rfc4514_string(), cert.issuer.rfc4514_string(), sans,
                            cert.not_valid_after_utc, is_ca))
    return out


def write_dev_pki(directory: str | Path, server_ip: str = "127.0.0.1") -> dict[str, Path]:
    """A throw-away CA, a server certificate for `server_ip` and a client certificate (tests, benches).

    Kept for `kv_cache.tls` and the transfer benchmarks; deployments use `crossfill certs init`.
    Returns paths keyed ca, server_cert, server_key, client_cert, client_key.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    issuer = _write_ca(d)
    out = {"ca": d / paths.CA_CERT}
    for who, hosts in (("server", [server_ip]), ("client", [])):
        out[f"{who}_cert"], out[f"{who}_key"] = write_cert(d, issuer, who, hosts)
    return out
