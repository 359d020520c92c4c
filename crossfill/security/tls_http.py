"""Mutual TLS on the HTTP hops between services, and the KV data plane's contexts from the same files.

Each service presents its own certificate from `security.dir` (crossfill.security.pki) and trusts
only the deployment's CA (ca.pem, never the system store), both as a server (uvicorn requires a
client certificate signed by that CA) and as a client (httpx verifies the peer's certificate and
host name). With `security.tls.enabled: false` everything here is empty and URLs are http.

The gateway's public listener is not a hop between services: clients authenticate there with API
keys (security.auth); the gateway is a TLS client of the scheduler and of decode all the same.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from crossfill.config import ConfigError, CrossfillConfig
from crossfill.kv import tls as kv_tls
from crossfill.security import paths


def scheme(cfg: CrossfillConfig) -> str:
    return cfg.http_scheme()


def service_files(cfg: CrossfillConfig, service: str) -> tuple[Path, Path, Path]:
    """(certificate, key, CA) of `service`, or a ConfigError naming security.dir when one is missing."""
    cert, key = paths.cert_paths(cfg, service)
    ca = paths.ca_path(cfg)
    for path, what in ((ca, "CA certificate"), (cert, f"certificate of {service!r}"), (key, f"key of {service!r}")):
        if not path.is_file():
            hint = (f"`crossfill certs issue {service} --config CONFIG --host HOST` for an instance added later"
                    if path != ca else "`crossfill certs init DIR --config CONFIG`")
            raise ConfigError(f"security.dir: the {what} {str(path)!r} is missing (security.tls.enabled is true); "
                              f"run {hint}, or `crossfill up`, which writes what a one-machine deployment lacks; "
                              "a multi-host deployment copies the folder's files to each host")
    return cert, key, ca


def server_context(cfg: CrossfillConfig, service: str) -> ssl.SSLContext:
    cert, key, ca = service_files(cfg, service)
    try:
        return kv_tls.server_context(cert, key, ca)
    except kv_tls.TLSConfigError as exc:
        raise ConfigError(f"security.dir: {exc}") from None


def client_context(cfg: CrossfillConfig, service: str) -> ssl.SSLContext:
    """Trusts only the deployment's CA, checks the peer's host name, presents `service`'s certificate."""
    cert, key, ca = service_files(cfg, service)
    try:
        return kv_tls.client_context(ca, cert, key)
    except kv_tls.TLSConfigError as exc:
        raise ConfigError(f"security.dir: {exc}") from None


def server_ssl_kwargs(cfg: CrossfillConfig, service: str) -> dict[str, Any]:
    """uvicorn.Config arguments that make `service` a mutual-TLS server ({} when TLS is off)."""
    if not cfg.security.tls.enabled:
        return {}
    cert, key, ca = service_files(cfg, service)
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key), "ssl_ca_certs": str(ca),
            "ssl_cert_reqs": ssl.CERT_REQUIRED}


def client_kwargs(cfg: CrossfillConfig, service: str) -> dict[str, Any]:
    """httpx client arguments for `service` calling other services ({} when TLS is off).

    The certificate is loaded into the context (httpx's `cert=` is deprecated), so `verify` alone
    carries both the trust and the identity.
    """
    if not cfg.security.tls.enabled:
        return {}
    return {"verify": client_context(cfg, service)}


def operator_kwargs(cfg: CrossfillConfig) -> dict[str, Any]:
    """httpx client arguments for tools and people (the operator certificate)."""
    return client_kwargs(cfg, paths.OPERATOR)
