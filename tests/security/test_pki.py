"""The deployment's PKI: certificates chain to the CA and hold up in real TLS handshakes, keys stay private,
`init` fills only what is missing, and the CLI writes and shows the folder."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from crossfill.config import ConfigError, CrossfillConfig, parse_config
from crossfill.kv.tls import client_context, server_context
from crossfill.security.pki import init_security_dir, issue
from crossfill.security.tls_http import client_kwargs, server_ssl_kwargs

REMOTE_HOST = "far.dc.example"  # a DNS name: the far datacenter's host


def _doc(directory: Path, tls: bool = True) -> dict:
    return {
        "inference_service": {"mode": "prefill_decode_disaggregated", "prefill_pool": {"replicas": 1},
                              "decode_pool": {"replicas": 1}},
        "security": {"dir": str(directory), "tls": {"enabled": tls}},
        "topology": {
            "local_datacenter": "here",
            "gateway": {"host": "10.0.0.5", "port": 8000},
            "scheduler": {"host": "10.0.0.5", "port": 8001},
            "datacenters": {
                "here": {"host": "10.0.0.6", "prefill": {"port": 8100}, "decode": {"port": 8200, "kv_port": 9200}},
                "far": {"host": REMOTE_HOST, "prefill": {"port": 8300}},
            },
            "links": [{"between": ["far", "here"], "bandwidth_gbps": 1.0, "latency_ms": 20, "emulate": False}],
        },
    }


def _cfg(directory: Path, tls: bool = True) -> CrossfillConfig:
    return parse_config(_doc(directory, tls))


SERVICES = ["gateway", "scheduler", "here-prefill-0", "here-decode-0", "far-prefill-0", "operator"]


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert: x509.Certificate) -> tuple[set, set[str]]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (set(san.get_values_for_type(x509.IPAddress)),
            set(san.get_values_for_type(x509.DNSName)))


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str) -> str:
    """One real TLS handshake over loopback; returns the client certificate's CN the server saw."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, object] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server.wrap_socket(conn, server_side=True) as tls:
                seen["peer"] = tls.getpeercert()
                tls.sendall(b"k")
        except (ssl.SSLError, OSError) as exc:
            seen["error"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as raw, \
                client.wrap_socket(raw, server_hostname=hostname) as tls:
            tls.recv(1)
    finally:
        t.join(10)
        listener.close()
    assert "error" not in seen, seen
    subject = dict(x[0] for x in seen["peer"]["subject"])  # type: ignore[index]
    return str(subject["commonName"])


def test_init_writes_a_ca_and_a_certificate_per_service(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "sec")
    written = init_security_dir(cfg)
    d = tmp_path / "sec"
    assert {p.name for p in written} == {"ca.pem", "ca.key", "tickets.json", "kv-master.key",
                                         *(f"{s}.pem" for s in SERVICES), *(f"{s}.key" for s in SERVICES)}
    ca = _cert(d / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for service in SERVICES:
        cert = _cert(d / f"{service}.pem")
        cert.verify_directly_issued_by(ca)  # raises unless signed by the CA
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == service
    # Private keys: 0600 from the first byte (the CA's too); certificates are public.
    for key in d.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert stat.S_IMODE((d / "tickets.json").stat().st_mode) == 0o600


def test_sans_carry_the_configured_host_as_ip_or_dns_plus_loopback(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    init_security_dir(cfg)
    ips, dns = _sans(_cert(tmp_path / "far-prefill-0.pem"))
    assert ips == {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    assert dns == {REMOTE_HOST, "localhost"}
    ips, dns = _sans(_cert(tmp_path / "scheduler.pem"))
    assert ipaddress.ip_address("10.0.0.5") in ips and dns == {"localhost"}
    ips, _ = _sans(_cert(tmp_path / "here-decode-0.pem"))
    assert ipaddress.ip_address("10.0.0.6") in ips


def test_certificates_work_in_a_mutual_tls_handshake_with_host_checks(tmp_path: Path) -> None:
    init_security_dir(_cfg(tmp_path))
    ca = tmp_path / "ca.pem"
    far = server_context(tmp_path / "far-prefill-0.pem", tmp_path / "far-prefill-0.key", ca)
    decode = client_context(ca, tmp_path / "here-decode-0.pem", tmp_path / "here-decode-0.key")
    assert _handshake(far, decode, REMOTE_HOST) == "here-decode-0"
    assert _handshake(far, decode, "127.0.0.1") == "here-decode-0"
    # The host check is real: the far prefill's certificate is not valid for the scheduler's address.
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch|doesn't match"):
        _handshake(far, decode, "10.0.0.5")


def test_init_is_idempotent_and_fills_only_what_is_missing(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    init_security_dir(cfg)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert init_security_dir(cfg) == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    (tmp_path / "far-prefill-0.pem").unlink()
    assert [p.name for p in init_security_dir(cfg)] == ["far-prefill-0.pem", "far-prefill-0.key"]
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after["far-prefill-0.pem"] != before["far-prefill-0.pem"]
    assert {k: v for k, v in after.items() if not k.startswith("far-prefill-0")} == \
           {k: v for k, v in before.items() if not k.startswith("far-prefill-0")}
    _cert(tmp_path / "far-prefill-0.pem").verify_directly_issued_by(_cert(tmp_path / "ca.pem"))


def test_a_new_ca_reissues_every_certificate_and_keeps_the_symmetric_keys(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    init_security_dir(cfg)
    tickets = (tmp_path / "tickets.json").read_bytes()
    old_ca = _cert(tmp_path / "ca.pem")
    written = {p.name for p in init_security_dir(cfg, force=True)}
    assert {"ca.pem", "ca.key", *(f"{s}.pem" for s in SERVICES)} <= written
    new_ca = _cert(tmp_path / "ca.pem")
    assert new_ca.public_key() != old_ca.public_key()
    for service in SERVICES:
        _cert(tmp_path / f"{service}.pem").verify_directly_issued_by(new_ca)
    assert (tmp_path / "tickets.json").read_bytes() == tickets


def test_issue_adds_a_certificate_for_an_instance_added_later(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    init_security_dir(cfg)
    cert, key = issue(cfg, "far-prefill-9", ["10.9.9.9", "p9.far.example"])
    c = _cert(cert)
    c.verify_directly_issued_by(_cert(tmp_path / "ca.pem"))
    ips, dns = _sans(c)
    assert ipaddress.ip_address("10.9.9.9") in ips and "p9.far.example" in dns
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="not a service name"):
        issue(cfg, "../escape", [])


def test_missing_files_are_a_config_error_naming_security_dir(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"security.dir: the CA certificate .* is missing.*crossfill certs init"):
        server_ssl_kwargs(cfg, "scheduler")
    with pytest.raises(ConfigError, match="security.dir"):
        client_kwargs(cfg, "gateway")
    off = _cfg(tmp_path / "empty", tls=False)
    assert server_ssl_kwargs(off, "scheduler") == {} and client_kwargs(off, "gateway") == {}
    assert off.instance("far-prefill-0").url.startswith("http://")
    assert cfg.instance("far-prefill-0").url.startswith("https://")
    assert cfg.instance("gateway").url.startswith("http://")  # the public listener: API keys, not certificates
    with pytest.raises(ConfigError, match="CA private key"):
        init_security_dir(cfg)  # nothing there yet: writes everything
        (tmp_path / "empty" / "ca.key").unlink()
        (tmp_path / "empty" / "gateway.pem").unlink()
        init_security_dir(cfg)  # a certificate to issue, and no CA key to sign it


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "crossfill.cli", "certs", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_init_issue_and_show(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(_doc(tmp_path / "unused")))
    out = _cli("init", str(tmp_path / "sec"), "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert "ca.pem" in out.stdout and "kv-master.key" in out.stdout
    assert f"security: {{dir: {tmp_path / 'sec'}}}" in out.stdout
    again = _cli("init", str(tmp_path / "sec"), "--config", str(config))
    assert "nothing missing" in again.stdout

    config.write_text(yaml.safe_dump(_doc(tmp_path / "sec")))
    out = _cli("issue", "here-decode-7", "--config", str(config), "--host", "10.0.0.77")
    assert out.returncode == 0, out.stderr
    shown = _cli("show", str(tmp_path / "sec"))
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("here-decode-7.pem"))
    assert "CN=here-decode-7" in line and "10.0.0.77" in line and "364 days left" in line
    assert any(x.startswith("ca.pem") and " CA " in x for x in shown.stdout.splitlines())

    bad = _cli("issue", "x", "--config", str(tmp_path / "nope.yaml"))
    assert bad.returncode == 2


def test_a_ca_bundle_trusts_old_and_new_certificates_during_a_ca_rotation(tmp_path: Path) -> None:
    """The documented rotation: ca.pem holds both CAs while services move to certificates of the new one."""
    old, new = tmp_path / "old", tmp_path / "new"
    init_security_dir(_cfg(old))
    init_security_dir(_cfg(new))
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes((new / "ca.pem").read_bytes() + (old / "ca.pem").read_bytes())
    server = server_context(new / "far-prefill-0.pem", new / "far-prefill-0.key", bundle)
    for d in (old, new):  # a caller not yet restarted, and one that was
        client = client_context(bundle, d / "here-decode-0.pem", d / "here-decode-0.key")
        assert _handshake(server, client, "127.0.0.1") == "here-decode-0"
    # Without the bundle the new CA alone refuses a certificate of the old one.
    strict = client_context(new / "ca.pem", old / "here-decode-0.pem", old / "here-decode-0.key")
    strict.maximum_version = ssl.TLSVersion.TLSv1_2  # the refusal happens inside the handshake
    with pytest.raises(ssl.SSLError):
        _handshake(server_context(new / "far-prefill-0.pem", new / "far-prefill-0.key", new / "ca.pem"), strict,
                   "127.0.0.1")
