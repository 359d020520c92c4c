"""Transfer tickets in the services: who signs, who checks what, and how a refusal is reported.

- scheduler: `sign(request_id, tenant, route)` with every route (`/v1/route` returns it as `ticket`);
- decode: `check_decode_job` before fetching any KV (the job's ticket is for this instance and the
  job's tenant), and `manifest_check` on every expected transfer: the receiver accepts a manifest
  only when its ticket binds that cache id, this instance, the tenant and the prefill decode asked;
- prefill: `check_prefill_job` before computing (this instance among the route's prefills, the
  job's decode and tenant, the cache id one of the ticket's request, not expired, not replayed).

Every refusal increments `crossfill_ticket_refusals_total{reason}`, is logged without any prompt
content, and is an audit record `ticket_refused`. With `security.tickets.enabled: false` every
check passes and nothing is signed (the behaviour before tickets existed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from crossfill.config import CrossfillConfig
from crossfill.kv.errors import Reason, WireError
from crossfill.kv.wire import Manifest
from crossfill.policy.routing import Route
from crossfill.security.audit import AuditLog
from crossfill.security.paths import ticket_keys_path
from crossfill.security.tickets import Clock, TicketKeys, TicketRefused, TicketSigner, TicketVerifier
from crossfill.serving.errors import APIError
from crossfill.serving.metrics import ServingMetrics
from crossfill.serving.protocol import DecodeJob, PrefillJob

log = logging.getLogger("crossfill.tickets")

REFUSED_CODE = "invalid_transfer_ticket"


class TicketGate:
    """One service's tickets: built at start-up, so missing or broken keys stop it (ConfigError)."""

    def __init__(self, cfg: CrossfillConfig, instance: str, metrics: ServingMetrics,
                 audit: AuditLog | None = None, clock: Clock = time.time) -> None:
        self.enabled = cfg.security.tickets.enabled
        self.instance = instance
        self.metrics = metrics
        self.audit = audit
        self.signer: TicketSigner | None = None
        self.verifier: TicketVerifier | None = None
        if self.enabled:
            keys = TicketKeys(ticket_keys_path(cfg))
            self.signer = TicketSigner(keys, cfg.security.tickets.ttl_s, clock)
            self.verifier = TicketVerifier(keys, cfg.inference_service.kv_cache.max_retry, clock)

    # -- scheduler ----------------------------------------------------------------------------
    def sign(self, request_id: str, tenant: str | None, route: Route) -> str | None:
        if self.signer is None:
            return None
        return self.signer.sign(request_id=request_id, tenant=tenant or "", decode=route.decode,
                                prefills=(route.prefill, *route.fallbacks))

    # -- prefill ------------------------------------------------------------------------------
    def check_prefill_job(self, job: PrefillJob) -> None:
        """Raise a 403 APIError unless `job`'s ticket lets this instance compute and send its KV."""
        if self.verifier is None:
            return
        try:
            self.verifier.verify(job.ticket, tenant=job.tenant_id or "", decode=job.decode_instance,
                                 prefill=self.instance, cache_id=job.cache_id)
        except TicketRefused as exc:
            self.refused(exc, "prefill_job", request_id=job.request_id, cache_id=job.cache_id,
                         tenant=job.tenant_id, decode=job.decode_instance)
            raise APIError(403, f"prefill instance {self.instance} refuses the job: transfer ticket {exc}",
                           param="ticket", code=REFUSED_CODE) from None

    # -- decode -------------------------------------------------------------------------------
    def check_decode_job(self, job: DecodeJob) -> None:
        """Raise a 403 APIError unless `job`'s ticket sends this request's KV to this instance."""
        if self.verifier is None:
            return
        try:
            self.verifier.verify(job.ticket, tenant=job.tenant_id or "", decode=self.instance)
        except TicketRefused as exc:
            self.refused(exc, "decode_job", request_id=job.request_id, tenant=job.tenant_id)
            raise APIError(403, f"decode instance {self.instance} refuses the job: transfer ticket {exc}",
                           param="ticket", code=REFUSED_CODE) from None

    def manifest_check(self, *, cache_id: str, tenant: str, prefill: str) -> Callable[[Manifest], None] | None:
        """The receiver's permission check for `cache_id` (None when tickets are off)."""
        verifier = self.verifier
        if verifier is None:
            return None

        def authorize(m: Manifest) -> None:
            try:
                verifier.verify(m.ticket, tenant=tenant, decode=self.instance, prefill=prefill, cache_id=cache_id)
            except TicketRefused as exc:
                self.refused(exc, "kv_manifest", request_id=m.request_id, cache_id=cache_id, tenant=tenant,
                             prefill=prefill)
                raise WireError(Reason.TICKET, f"transfer ticket {exc}") from None

        return authorize

    # -- refusals -----------------------------------------------------------------------------
    def refused(self, exc: TicketRefused, where: str, **fields: str | None) -> None:
        self.metrics.ticket_refusals.labels(exc.reason).inc()
        log.warning("%s: transfer ticket refused (%s) at %s: %s %s", self.instance, exc.reason, where, exc.message,
                    " ".join(f"{k}={v}" for k, v in fields.items() if v is not None))
        if self.audit is not None:
            self.audit.record("ticket_refused", instance=self.instance, where=where, reason=exc.reason,
                              detail=exc.message, **{k: v for k, v in fields.items() if v is not None})
