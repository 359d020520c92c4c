"""M8's troubleshooting table as data: symptom -> evidence -> cause -> fix, each rule a pure check.

`crossfill diagnose` (crossfill.observability.diagnose) reads a running cluster twice and hands the
two `Snapshot`s to `evaluate()`. Each `Rule` looks at a `Window` (the later snapshot's state, and
how every counter grew since the earlier one) and returns the evidence it found, as sentences with
the numbers in them; no evidence, no finding. Nothing here does I/O, so every rule runs the same on
a live cluster, on snapshots saved with `--save`, and on snapshots a unit test builds.

Where a quantity already has an owner its verdict is used, never re-derived: a link is slow or
lossy when the scheduler's link monitor says so (its hysteresis and thresholds are the routing
policy's), and the numbers it saw are shown as evidence.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

# One Prometheus sample: (name, labels, value), e.g. ("crossfill_errors_total", {"code": "x"}, 3.0).
Sample = tuple[str, dict[str, str], float]


@dataclass(frozen=True)
class Facts:
    """What the config file says (known with --config; unknown with --url alone)."""

    threshold_tokens: int | None = None  # routing.long_context_threshold_tokens
    compression_enabled: bool | None = None  # kv_cache.compression_enabled
    max_retry: int | None = None  # kv_cache.max_retry
    timeout_ms: int | None = None  # kv_cache.timeout_ms


@dataclass(frozen=True)
class Service:
    """One process as diagnose read it: its /metrics samples and (workers) its /v1/admin/stats."""

    name: str
    role: str  # gateway | scheduler | prefill | decode
    datacenter: str | None = None
    samples: tuple[Sample, ...] | None = None  # None: /metrics could not be read
    stats: dict[str, Any] | None = None  # workers' /v1/admin/stats
    error: str | None = None  # why something of it could not be read


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # wall-clock seconds (time.time())
    services: dict[str, Service]
    cluster: dict[str, Any] | None = None  # the scheduler's /v1/admin/cluster
    plan: dict[str, Any] | None = None  # the scheduler's /v1/admin/plan
    facts: Facts = field(default_factory=Facts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        d = json.loads(text)
        services = {}
        for name, s in d["services"].items():
            samples = None if s.get("samples") is None else tuple((n, dict(lb), float(v)) for n, lb, v in s["samples"])
            services[name] = Service(s["name"], s["role"], s.get("datacenter"), samples, s.get("stats"), s.get("error"))
        return cls(d["taken_at"], services, d.get("cluster"), d.get("plan"), Facts(**d.get("facts") or {}))


@dataclass(frozen=True)
class Limits:
    """How much of a symptom makes a finding. Counters: how much they must grow within the window."""

    transfer_failures: int = 1  # KV retries / checksum failures / failed transfers
    refusals: int = 1  # 429s of a full pool
    decode_silent: int = 1
    short_remote_min: int = 3  # remote requests seen before their prompt lengths are judged
    uncompressed_ratio: float = 0.95  # KV wire/raw at or above this: compression does nothing
    busy_link_share: float = 0.5  # of the link's bandwidth carried by KV: a busy link
    saturated_link_share: float = 0.9  # of the link's bandwidth: the link is what limits remote prefill
    min_hit_rate: float = 0.1  # prefix-cache hit tokens / tokens looked up
    hit_rate_min_tokens: int = 50_000  # tokens looked up (per side) before the hit rate is judged


def _key(name: str, labels: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


class Window:
    """The later snapshot's state plus each counter's growth since the earlier one (None: since start)."""

    def __init__(self, after: Snapshot, before: Snapshot | None = None, limits: Limits | None = None) -> None:
        self.after, self.before = after, before
        self.limits = limits or Limits()

    @property
    def span(self) -> str:
        """How the evidence's counts are meant: over the window, or since each process started."""
        if self.before is None:
            return "since the processes started"
        return f"in {self.after.taken_at - self.before.taken_at:.1f} s"

    def services(self, roles: tuple[str, ...] | None = None) -> Iterator[Service]:
        return (s for s in self.after.services.values() if roles is None or s.role in roles)

    def increase(self, name: str, roles: tuple[str, ...] | None = None, **labels: str) -> float:
        """Sum over `roles`' services of how much counter `name` (labels matching `labels`) grew."""
        total = 0.0
        for svc in self.services(roles):
            earlier = self._series(self.before.services.get(svc.name) if self.before else None)
            for key, value in self._series(svc).items():
                if key[0] != name or any(dict(key[1]).get(k) != v for k, v in labels.items()):
                    continue
                prev = earlier.get(key, 0.0)
                total += value - prev if value >= prev else value  # a restarted process counts from zero
        return total

    def increase_by(self, name: str, label: str, roles: tuple[str, ...] | None = None) -> dict[str, float]:
        """`increase` split by the value of `label`."""
        values = {dict(k[1]).get(label, "") for s in self.services(roles) for k in self._series(s) if k[0] == name}
        return {v: self.increase(name, roles, **{label: v}) for v in sorted(values)}

    def has_metric(self, name: str) -> bool:
        return any(k[0] == name for s in self.services() for k in self._series(s))

    @staticmethod
    def _series(svc: Service | None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        if svc is None or svc.samples is None:
            return {}
        return {_key(n, lb): v for n, lb, v in svc.samples}

    def instances(self, role: str) -> dict[str, dict[str, Any]]:
        """Each `role` instance's state: the scheduler's view, else the worker's own stats."""
        out: dict[str, dict[str, Any]] = {}
        for name, inst in ((self.after.cluster or {}).get("instances") or {}).items():
            if inst.get("role") == role:
                out[name] = dict(inst)
        for svc in self.services((role,)):
            if svc.stats is not None:  # the worker's own numbers are fresher than the last probe's
                out[svc.name] = {**out.get(svc.name, {}), **svc.stats}
        return out

    def links(self) -> dict[str, dict[str, Any]]:
        return dict((self.after.cluster or {}).get("links") or {})

    def link_increase(self, dc: str, key: str) -> float:
        now = self.links().get(dc, {}).get(key) or 0
        earlier = ((self.before.cluster or {}).get("links") or {}).get(dc, {}).get(key) if self.before else 0
        earlier = earlier or 0
        return float(now - earlier if now >= earlier else now)


# --------------------------------------------------------------------------- the checks


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _link_gbps(link: dict[str, Any]) -> float | None:
    gbps = link.get("bandwidth_gbps") or link.get("configured_bandwidth_gbps")
    return float(gbps) if gbps else None


def check_link_slow(w: Window) -> list[str]:
    """The scheduler's link monitor judges a link unusable (slow, lossy, down, breaker open)."""
    out = []
    for dc, lk in w.links().items():
        if lk.get("usable", True):
            continue
        rtt, bw = lk.get("rtt_ms"), lk.get("bandwidth_gbps")
        numbers = [f"RTT {rtt:.1f} ms" if rtt is not None else "RTT not measured",
                   f"bandwidth {bw:.3g} Gbit/s" if bw is not None else "bandwidth not measured",
                   f"loss {lk.get('loss_rate', 0.0):.1%}", f"breaker {lk.get('breaker', '?')}",
                   "up" if lk.get("up", True) else "DOWN"]
        why = lk.get("reason") or "; ".join(lk.get("reasons") or []) or "unusable"
        out.append(f"link {dc}: {why} ({', '.join(numbers)}); remote prefill over it is off until it recovers")
    return out


def check_link_saturated(w: Window) -> list[str]:
    """KV traffic fills the link: bandwidth below what remote prefill needs."""
    out = []
    for dc, lk in w.links().items():
        gbps = _link_gbps(lk)
        carried = float(lk.get("egress_bytes_per_s") or 0.0) * 8 / 1e9
        if gbps and carried >= w.limits.saturated_link_share * gbps:
            out.append(f"link {dc} carried {carried:.3g} Gbit/s of KV, {carried / gbps:.0%} of its {gbps:.3g} Gbit/s")
    util = ((w.after.plan or {}).get("recommended") or {}).get("link_utilisation")
    if isinstance(util, int | float) and util >= 1.0:
        out.append(f"the planner's model puts the link at {util:.0%} of its bandwidth at the observed arrival rate "
                   "and live threshold (GET /v1/admin/plan)")
    return out


def check_transfer_failures(w: Window) -> list[str]:
    """KV frames fail verification or are lost and are sent again; transfers fail and are retried."""
    out = []
    lim = w.limits.transfer_failures
    checksum = w.increase("crossfill_kv_checksum_failures_total")
    if checksum >= lim:
        out.append(f"{checksum:.0f} KV frame(s) failed their checksum {w.span}")
    refused = {r: v for r, v in w.increase_by("crossfill_kv_frames_refused_total", "reason", ("decode",)).items()
               if v >= lim and r != "checksum"}
    if refused:
        out.append("decode refused KV frames: " + ", ".join(f"{r} {v:.0f}" for r, v in refused.items()))
    resent = w.increase("crossfill_kv_frames_retransmitted_total", ("prefill",))
    if resent >= lim:
        sent = w.increase("crossfill_kv_frames_sent_total", ("prefill",))
        out.append(f"prefill retransmitted {resent:.0f} KV frame(s) (of {sent:.0f} sent) {w.span}: "
                   "the stream broke or the receiver refused them")
    failed = w.increase("crossfill_kv_transfers_total", ("decode",), outcome="failed")
    if failed >= lim:
        out.append(f"{failed:.0f} KV transfer attempt(s) failed {w.span}")
    retries = w.increase("crossfill_kv_retries_total", ("decode",))
    if retries >= lim:
        out.append(f"decode retried {retries:.0f} KV transfer attempt(s) {w.span}")
    for dc in w.links():
        failed = w.link_increase(dc, "transfers_failed")
        if failed >= lim:
            ok = w.link_increase(dc, "transfers_ok")
            out.append(f"link {dc}: {failed:.0f} failed transfer(s) and {ok:.0f} good ones {w.span}")
    fallbacks = w.increase("crossfill_fallbacks_total", ("decode",), reason="prefill_failed")
    if out and fallbacks:
        out.append(f"{fallbacks:.0f} request(s) fell back to another prefill instance after failed attempts")
    return out


def _full(inst: dict[str, Any]) -> bool:
    return int(inst.get("queue_depth") or 0) >= int(inst.get("capacity") or 1) > 0


def check_prefill_backlog(w: Window) -> list[str]:
    """Prefill queues at max_queue_depth; requests refused with 429 prefill_queue_full."""
    out = [f"prefill {name} queue {inst.get('queue_depth')}/{inst.get('capacity')} (prefill_pool.max_queue_depth)"
           for name, inst in w.instances("prefill").items() if _full(inst)]
    refused = w.increase("crossfill_errors_total", ("scheduler", "prefill"), code="prefill_queue_full")
    if refused >= w.limits.refusals:
        out.append(f"{refused:.0f} request(s) refused with 429 prefill_queue_full {w.span}")
    rec = (w.after.plan or {}).get("recommended") or {}
    inputs = (w.after.plan or {}).get("inputs") or {}
    if out and rec.get("remote_prefill_instances") is not None:
        out.append(f"the planner recommends {rec.get('local_prefill_instances')} local and "
                   f"{rec.get('remote_prefill_instances')} remote prefill instance(s) (running: "
                   f"{inputs.get('local_prefill_instances')} local, {inputs.get('remote_prefill_instances')} remote)")
    return out


def check_decode_full(w: Window) -> list[str]:
    """Decode at max_concurrent_requests or out of KV blocks; requests refused 429/503."""
    out = []
    for name, inst in w.instances("decode").items():
        if _full(inst):
            out.append(f"decode {name} holds {inst.get('queue_depth')}/{inst.get('capacity')} requests "
                       "(decode_pool.max_concurrent_requests)")
        kv = inst.get("kv") or {}
        total, used = int(kv.get("blocks_total") or 0), int(kv.get("blocks_used") or 0)
        if total and used >= total:
            out.append(f"decode {name} uses all {total} KV blocks")
    for code in ("decode_full", "decode_kv_full"):
        refused = w.increase("crossfill_errors_total", ("scheduler", "decode"), code=code)
        if refused >= w.limits.refusals:
            out.append(f"{refused:.0f} request(s) refused with {code} {w.span}")
    return out


def check_decode_silent(w: Window) -> list[str]:
    """The gateway saw a decode instance go silent after its route was set up (M8.4)."""
    out = []
    silent = w.increase("crossfill_errors_total", ("gateway",), code="decode_silent")
    if silent >= w.limits.decode_silent:
        out.append(f"the gateway found decode silent {silent:.0f} time(s) {w.span}")
        moved = w.increase("crossfill_fallbacks_total", ("gateway",), reason="reschedule")
        if moved:
            out.append(f"{moved:.0f} request(s) rescheduled on another decode instance")
    return out


def check_instances_down(w: Window) -> list[str]:
    """An instance fails its health checks, or diagnose itself could not read it."""
    out = []
    for name, inst in ((w.after.cluster or {}).get("instances") or {}).items():
        if inst.get("state", "active") == "active" and not inst.get("healthy", True):
            out.append(f"{inst.get('role', 'instance')} {name} fails the scheduler's health checks "
                       f"({inst.get('failures')} in a row: {inst.get('last_error')})")
    for svc in w.services():
        if svc.error:
            out.append(f"{svc.role} {svc.name}: {svc.error}")
    return out


def check_short_prompts_remote(w: Window) -> list[str]:
    """Prompts under the threshold prefilled remotely: their KV crosses the link for little gain.

    The gateway counts requests and their prompt tokens by route; remote requests whose mean prompt
    is under the configured threshold include short ones (a few short among many long stay unseen)."""
    configured = w.after.facts.threshold_tokens
    live = (w.after.cluster or {}).get("threshold_tokens")
    threshold = configured or live
    remote = w.increase("crossfill_requests_total", ("gateway",), route="remote", outcome="ok")
    if not threshold or remote < w.limits.short_remote_min:
        return []
    tokens = w.increase("crossfill_request_prompt_tokens_total", ("gateway",), route="remote")
    mean = tokens / remote
    if not tokens or mean >= threshold:
        return []
    out = [f"{remote:.0f} remote prefills {w.span} averaged {mean:.0f} prompt tokens, under the "
           f"{threshold}-token threshold (routing.long_context_threshold_tokens)"]
    if live and configured and live < configured:
        out.append(f"the scheduler re-tuned the live threshold down to {live} tokens")
    why = {r: v for r, v in w.increase_by("crossfill_routing_decisions_total", "reason", ("scheduler",)).items()
           if v and r.startswith(("policy_remote", "batch_remote"))}
    if why:
        out.append("remote by request: " + ", ".join(f"{r} {v:.0f}" for r, v in why.items()))
    return out


def check_uncompressed_busy_link(w: Window) -> list[str]:
    """KV crosses uncompressed while the link is busy: compression would cut the bytes."""
    raw = w.increase("crossfill_kv_raw_bytes_total", ("decode",))
    wire = w.increase("crossfill_kv_wire_bytes_total", ("decode",))
    off = w.after.facts.compression_enabled is False
    if not raw or (wire / raw < w.limits.uncompressed_ratio and not off):
        return []
    busy = []
    for dc, lk in w.links().items():
        gbps = _link_gbps(lk)
        carried = float(lk.get("egress_bytes_per_s") or 0.0) * 8 / 1e9
        if gbps and carried >= w.limits.busy_link_share * gbps:
            busy.append(f"link {dc} at {carried / gbps:.0%} of {gbps:.3g} Gbit/s")
    if not busy:
        return []
    how = "kv_cache.compression_enabled is false" if off else "the codec saves nothing"
    return [f"KV wire/raw {wire / raw:.2f} ({_fmt_bytes(wire)} of {_fmt_bytes(raw)} {w.span}; {how}) "
            f"while {', '.join(busy)}"]


def check_low_hit_rate(w: Window) -> list[str]:
    """Little of the prompts' KV comes from a prefix cache: repeated prefills and transfers (cost)."""
    out = []
    queried = w.increase_by("crossfill_prefix_cache_query_tokens_total", "side", ("prefill", "decode"))
    for side, query in queried.items():
        if query < w.limits.hit_rate_min_tokens:
            continue  # too little traffic to call the rate low
        hits = w.increase("crossfill_prefix_cache_hit_tokens_total", ("prefill", "decode"), side=side)
        if hits / query < w.limits.min_hit_rate:
            out.append(f"{side} prefix-cache hit rate {hits / query:.1%}: {hits:.0f} of {query:.0f} prompt tokens "
                       f"{w.span}")
    return out


@dataclass(frozen=True)
class Rule:
    id: str
    m8: str  # the MISSION M8 item it implements
    symptom: str
    cause: str
    fix: str
    check: Callable[[Window], list[str]]


RULES: tuple[Rule, ...] = (
    Rule("instance_down", "M8.4", "An instance is down or unreadable",
         "the process died, hangs, or its port is not reachable (network policy, certificates)",
         "check its log and /readyz; `crossfill up` restarts a dead child; the scheduler routes around it meanwhile",
         check_instances_down),
    Rule("link_slow", "M8.1", "Cross-DC link slow, lossy or down",
         "link latency or bandwidth outside network.max_latency_ms / min_bandwidth_gbps, loss, or repeated "
         "transfer failures opened the circuit breaker",
         "check the link (RTT, bandwidth, loss); give KV a dedicated link or queue (network.isolated_transport_queue); "
         "keep kv_cache.compression_enabled on; raise routing.long_context_threshold_tokens so fewer prompts cross",
         check_link_slow),
    Rule("link_saturated", "M8.2", "Link bandwidth below what remote prefill needs",
         "long inputs, big batches or repeated transfers fill the link",
         "compress KV, reuse prefixes (shared system prompts), keep more prompts local (raise the threshold), "
         "move batch work off-peak, or add link capacity",
         check_link_saturated),
    Rule("kv_transfer_failures", "M8.3", "KV transfer or checksum failures rising",
         "loss or corruption on the link, kv_cache.timeout_ms too short, receiver out of memory, expired cache",
         "check the link's loss/retransmits; raise kv_cache.max_retry or timeout_ms; keep "
         "routing.fallback_to_local_on_failure on so requests still finish locally",
         check_transfer_failures),
    Rule("prefill_backlog", "M8.1", "Prefill backlog",
         "prefill queues at prefill_pool.max_queue_depth: more long prompts than the pool can prefill",
         "add prefill instances (prefill_pool.replicas, or POST /v1/admin/instances); raise max_queue_depth only "
         "if the instances have headroom",
         check_prefill_backlog),
    Rule("decode_full", "M8.4", "Decode full",
         "decode at decode_pool.max_concurrent_requests or out of KV blocks",
         "add decode instances (decode_pool.replicas); raise max_concurrent_requests or "
         "resource_classes.<class>.kv_memory_mb if memory allows; cap max_tokens",
         check_decode_full),
    Rule("decode_silent", "M8.4", "Remote prefill succeeded but decode silent",
         "decode stuck or overloaded, cannot fetch the KV (KV port unreachable, network policy), id mismatch",
         "check the decode instance's log for the request ids and that prefill reaches its kv_port; the gateway "
         "reschedules on another decode; check kv_cache.timeout_ms",
         check_decode_silent),
    Rule("short_prompts_remote", "M8.1", "Short prompts routed remote",
         "the live threshold was re-tuned low, or clients ask for remote_required/remote_preferred",
         "raise routing.long_context_threshold_tokens (and routing.pin_threshold: true to keep it); let clients "
         "use prefill_policy auto",
         check_short_prompts_remote),
    Rule("kv_uncompressed_busy_link", "M8.2", "KV crosses uncompressed on a busy link",
         "kv_cache.compression_enabled is false (or the codec saves nothing) while KV fills the link",
         "set kv_cache.compression_enabled: true (compression_mode hybrid_attention)",
         check_uncompressed_busy_link),
    Rule("low_prefix_hit_rate", "M8.5", "Low prefix-cache hit rate",
         "no shared prefixes (system prompts, conversation history) or caches too small to keep them",
         "put shared system prompts first and keep them identical; raise kv_memory_mb; route conversations "
         "with their tenant id so their KV is found",
         check_low_hit_rate),
)


@dataclass(frozen=True)
class Finding:
    rule: Rule
    evidence: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        r = self.rule
        return {"rule": r.id, "m8": r.m8, "symptom": r.symptom, "evidence": list(self.evidence),
                "cause": r.cause, "fix": r.fix}


def evaluate(window: Window, rules: tuple[Rule, ...] = RULES) -> list[Finding]:
    """Every rule whose check finds evidence in `window`, in table order."""
    return [Finding(r, tuple(ev)) for r in rules if (ev := r.check(window))]
