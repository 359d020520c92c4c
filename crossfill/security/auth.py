"""Who is calling: API-key authentication for the gateway, admin keys for the scheduler's admin API.

A key arrives as `Authorization: Bearer KEY` (OpenAI clients) or `api-key` / `x-api-key` (Azure
OpenAI and other clients). No key or an unknown one is a 401 in OpenAI's form (code
`invalid_api_key`, `WWW-Authenticate: Bearer`). The key's tenant is the request's tenant: it
replaces whatever the body says everywhere downstream (routing, the prefix-cache namespace, KV
reuse, the route report), so no tenant can reach another's cached KV, or learn from a faster
answer that another tenant sent a prompt (the prefix-cache timing side channel). A body naming
another tenant is refused (403 `tenant_mismatch`) rather than silently rewritten, so a
misconfigured client learns why. With `security.auth.enabled: false` (`--no-auth`) the body's
`tenant_id` is trusted, as before.

Refusals are audited (auth_failed, permission_denied) with the key's public key_id, the client's
address and the path, never the key, throttled per address so a flood cannot flood the log.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from starlette.requests import Request

from crossfill.config import CrossfillConfig
from crossfill.security.audit import AuditLog
from crossfill.security.keys import Identity, KeyStore, hash_key, key_id
from crossfill.security.limits import AuditThrottle
from crossfill.serving.errors import APIError

log = logging.getLogger("crossfill.security")

# `crossfill up --no-auth` / `serve --no-auth` pass this to every process they start.
NO_AUTH_ENV = "CROSSFILL_NO_AUTH"
ADMIN_PREFIX = "/v1/admin/"


class AuthError(APIError):
    """401/403 in OpenAI's form: type invalid_request_error, and the challenge header on a 401."""

    @property
    def type(self) -> str:
        return "invalid_request_error"

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **({"WWW-Authenticate": "Bearer"} if self.status == 401 else {})}


def no_auth_requested() -> bool:
    return os.environ.get(NO_AUTH_ENV, "") not in ("", "0")


def apply_no_auth(cfg: CrossfillConfig) -> CrossfillConfig:
    """`cfg` with authentication off when `--no-auth` asked for it (CROSSFILL_NO_AUTH=1), else `cfg`."""
    if not no_auth_requested() or not cfg.security.auth.enabled:
        return cfg
    auth = cfg.security.auth.model_copy(update={"enabled": False})
    return cfg.model_copy(update={"security": cfg.security.model_copy(update={"auth": auth})})


def presented_key(headers: Any) -> str | None:
    """The API key in `headers` (Starlette Headers), or None when none was sent."""
    value = headers.get("authorization")
    if value:
        scheme, _, token = value.strip().partition(" ")
        return (token.strip() or None) if scheme.lower() == "bearer" else None
    for name in ("api-key", "x-api-key"):
        value = headers.get(name)
        if value:
            return value.strip()
    return None


class Authenticator:
    """API-key checks of one service; disabled (everyone is anonymous) when security.auth is off."""

    def __init__(self, keys: KeyStore | None, audit: AuditLog | None, throttle: AuditThrottle | None = None) -> None:
        self.keys = keys
        self.audit = audit
        # A few refusals per address are all recorded; a flood is summarised at one record per second.
        self.throttle = throttle or AuditThrottle(burst=10, per_s=1)

    @classmethod
    def from_config(cls, cfg: CrossfillConfig, audit: AuditLog | None) -> Authenticator:
        """Raises ConfigError (naming security.auth) when auth is on and no key exists."""
        return cls(KeyStore.from_config(cfg) if cfg.security.auth.enabled else None, audit)

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def authenticate(self, request: Request) -> Identity | None:
        """The caller's identity; None when auth is off. A 401 when the key is missing or unknown."""
        if self.keys is None:
            return None
        key = presented_key(request.headers)
        ident = self.keys.lookup(key) if key else None
        if ident is None:
            kid = key_id(hash_key(key)) if key else None
            self._audit(request, "auth_failed", key_id=kid, reason="unknown key" if key else "no key")
            raise AuthError(401, "Incorrect API key provided. Send it as `Authorization: Bearer KEY`." if key else
                            "You didn't provide an API key. Send it as `Authorization: Bearer KEY` "
                            "(keys: `crossfill keys add TENANT`).", code="invalid_api_key")
        return ident

    def tenant(self, request: Request, ident: Identity | None, body_tenant: str | None) -> str | None:
        """The tenant a request runs as: the key's, or (auth off) the body's. 403 when they differ."""
        if ident is None:
            return body_tenant
        if body_tenant is not None and body_tenant != ident.tenant:
            self._audit(request, "permission_denied", key_id=ident.key_id, tenant=ident.tenant,
                        reason="tenant_mismatch")
            raise AuthError(403, f"tenant_id {body_tenant!r} is not the tenant of this API key; omit tenant_id "
                            "or send the key's own", param="tenant_id", code="tenant_mismatch")
        return ident.tenant

    def require_admin(self, request: Request) -> Identity | None:
        """An admin key's identity (None when auth is off): 401 without a valid key, 403 with a tenant key."""
        ident = self.authenticate(request)
        if ident is not None and not ident.admin:
            self._audit(request, "permission_denied", key_id=ident.key_id, tenant=ident.tenant, reason="not_admin")
            raise AuthError(403, "this API key may not call the admin endpoints (make one with "
                            "`crossfill keys add TENANT --admin`)", code="permission_denied")
        return ident

    def _audit(self, request: Request, event: str, **fields: Any) -> None:
        if self.audit is None:
            return
        ip = request.client.host if request.client else None
        dropped = self.throttle.allow(f"{event}:{ip}")
        if dropped is None:
            return
        self.audit.record(event, client=ip, path=request.url.path, method=request.method,
                          **({"suppressed": dropped} if dropped else {}), **fields)


class AdminAuth:
    """ASGI middleware: every `/v1/admin/...` call needs an admin key; mutating ones are audited.

    A middleware rather than a check in each handler, so an admin endpoint added later is
    protected without anyone remembering to.
    """

    def __init__(self, app: Any, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ADMIN_PREFIX):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            ident = self.auth.require_admin(request)
        except AuthError as err:
            await err.response()(scope, receive, send)
            return
        if request.method in ("GET", "HEAD", "OPTIONS") or self.auth.audit is None:
            await self.app(scope, receive, send)
            return
        status = 500  # what the record says when the handler never answered

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            self.auth.audit.record("admin_action", path=request.url.path, method=request.method,
                                   tenant=ident.tenant if ident else None, key_id=ident.key_id if ident else None,
                                   outcome=status, client=request.client.host if request.client else None)


def log_auth_mode(cfg: CrossfillConfig, service: str) -> None:
    """Say at start-up how callers are authenticated; loudly when nobody is."""
    if cfg.security.auth.enabled:
        log.info("%s: API keys required (security.auth)", service)
    else:
        log.warning("%s: AUTHENTICATION IS OFF (security.auth.enabled false or --no-auth): anyone who can reach "
                    "this port may call it as any tenant; never expose it beyond this machine", service)


def startup_banner(cfg: CrossfillConfig) -> list[str]:
    """What `crossfill up` tells its user about API keys (the dev keys themselves: they are demo keys).

    Raises ConfigError (naming security.auth) when authentication is on and no key exists.
    """
    auth = cfg.security.auth
    if not auth.enabled:
        return ["WARNING: authentication is OFF (--no-auth or security.auth.enabled false): anyone who can reach "
                "the gateway may call it as any tenant"]
    store = KeyStore.from_config(cfg)
    lines = [f"API key for tenant {k.tenant}{' (admin)' if k.admin else ''}: {k.key}  (security.auth.dev_keys: "
             "for demos only)" for k in auth.dev_keys]
    if store.keys_file is not None:
        lines.append(f"keys file {store.keys_file}: {len(store.records()) - len(auth.dev_keys)} key(s) "
                     "(`crossfill keys list`)")
    return lines
