"""Time and bytes estimates behind routing decisions: pure arithmetic over a snapshot.

Prefill time of an instance = its queue ahead of the request times this request's uncached
compute (a proxy for a job's length that needs no history), plus the compute itself, at the
instance's measured tokens/s. A remote path adds the round trip and overlaps the KV transfer with
prefill (KV streams layer by layer while prefill computes), so it costs max(compute, transfer).
The transfer waits behind the bytes already in flight on the link (congestion back-off). The
datacenter's cost weight scales the whole path.

The offload gate answers "does the link move this KV faster than local prefill would make it?" It
compares capacities, not latencies: the round trip is a latency every remote request pays, which the
long-prompt threshold (re-tuned from the planner's throughput model) accounts for. It is linear in
the prompt length with a slope of (local seconds per token - link seconds per token), so it is
monotone: when the link carries KV faster than local prefill makes it, a longer prompt only gains
from crossing; when it does not, no prompt does. (Queue waits are left out of the gate on purpose:
they depend on the request's own size in this model and would break that monotonicity; the
ranking of instances, not the gate, reacts to queues.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crossfill.config import InferenceServiceConfig

if TYPE_CHECKING:
    from crossfill.policy.routing import InstanceState, LinkState, Snapshot


@dataclass(frozen=True)
class Gate:
    offload: bool
    why: str


class Estimates:
    def __init__(self, snapshot: Snapshot, config: InferenceServiceConfig, prompt_tokens: int, held: int) -> None:
        self.snap, self.cfg, self.routing = snapshot, config, config.routing
        self.prompt, self.held = prompt_tokens, held
        self.links = {lk.datacenter: lk for lk in snapshot.links}

    @property
    def threshold(self) -> int:
        live = self.snap.threshold_tokens
        if self.routing.pin_threshold or live is None:
            return self.routing.long_context_threshold_tokens
        return live

    def incremental(self, locals_: Sequence[InstanceState], cached: Callable[[str], int]) -> int:
        """Tokens that make a prompt "long": neither cached on local prefill nor held by decode.

        Measured against the local side because that is the cost the threshold weighs: a prompt
        whose prefix local prefill (or decode) already has is cheap to serve here, however long it
        is; one cached only in a remote pool is still long here, and the remote instance holding it
        then wins the ranking.
        """
        best_local = max((cached(s.name) for s in locals_), default=0)
        return self.prompt - max(best_local, self.held)

    def tokens_per_s(self, s: InstanceState) -> float:
        return s.prefill_tokens_per_s or self.routing.assumed_prefill_tokens_per_s

    def bandwidth_bps(self, link: LinkState | None) -> float | None:
        if link is None:
            return None
        gbps = link.bandwidth_gbps if link.bandwidth_gbps is not None else link.configured_bandwidth_gbps
        return None if gbps is None else gbps * 1e9

    def transfer_seconds(self, link: LinkState | None, tokens: int, *, rtt: bool = True) -> float:
        """Sending `tokens` tokens' KV behind what is in flight (+ one round trip); 0 if unknown."""
        bw, bpt = self.bandwidth_bps(link), self.snap.kv_bytes_per_token
        rtt_s = 2 * (link.latency_ms or 0.0) / 1000 if link is not None and rtt else 0.0
        if bw is None or bpt is None or link is None:
            return rtt_s
        return (link.in_flight_bytes + max(tokens, 0) * bpt) * 8 / bw + rtt_s

    def path_seconds(self, s: InstanceState, cached: int) -> float:
        compute = max(self.prompt - cached, 1) / self.tokens_per_s(s)
        wait = (s.queue_depth + s.pending) * compute
        weight = self.routing.cost_weight(s.datacenter)
        if s.datacenter == self.snap.local_datacenter:
            return (wait + compute) * weight
        link = self.links.get(s.datacenter)
        return (wait + max(compute, self.transfer_seconds(link, self.prompt - self.held))) * weight

    def egress_gate(self, remotes: Sequence[InstanceState]) -> Gate:
        budget = self.routing.egress_budget_bytes_per_s
        if budget is None:
            return Gate(True, "no egress budget")
        for s in remotes:
            link = self.links.get(s.datacenter)
            if link is None or link.egress_bytes_per_s < budget:
                return Gate(True, "within the egress budget")
        used = max((self.links[s.datacenter].egress_bytes_per_s for s in remotes if s.datacenter in self.links),
                   default=0.0)
        return Gate(False, f"egress budget reached: {used / 1e6:.3g} MB/s >= "
                           f"routing.egress_budget_bytes_per_s {budget / 1e6:.3g} MB/s")


def offload_gate(est: Estimates, locals_: Sequence[InstanceState], remotes: Sequence[InstanceState],
                 local_cached: Sequence[int], remote_cached: Sequence[int]) -> Gate:
    """Whether offloading to one of `remotes` beats prefilling on one of `locals_` (see module doc)."""
    budget = est.egress_gate(remotes)
    if not budget.offload:
        return budget
    if not est.routing.bandwidth_aware:
        return Gate(True, "routing.bandwidth_aware is off")
    if not locals_:
        return Gate(True, "no local prefill to compare with")
    bpt = est.snap.kv_bytes_per_token
    if bpt is None:
        return Gate(True, "KV bytes per token not measured yet: the link is trusted")
    local = est.snap.local_datacenter
    local_s_per_tok = 1 / max(est.tokens_per_s(s) for s in locals_)
    w_local = est.routing.cost_weight(local)
    local_tokens = est.prompt - max(local_cached, default=0)
    send_tokens = est.prompt - est.held
    best: tuple[float, str] | None = None
    slow: list[str] = []
    for s in remotes:
        link = est.links.get(s.datacenter)
        bw = est.bandwidth_bps(link)
        if bw is None:
            return Gate(True, f"{s.datacenter}: bandwidth not known: the link is trusted")
        link_s_per_tok = bpt * 8 / bw
        w = est.routing.cost_weight(s.datacenter)
        if w * link_s_per_tok >= w_local * local_s_per_tok:
            slow.append(f"{s.datacenter} carries KV at {1 / link_s_per_tok:.0f} tok/s"
                        f"{f' (cost weight {w:g})' if w != w_local else ''}, no faster than local prefill "
                        f"at {1 / local_s_per_tok:.0f} tok/s")
            continue
        send = est.transfer_seconds(link, send_tokens, rtt=False)
        compute = local_tokens * local_s_per_tok
        saved = w_local * compute - w * send
        if best is None or saved > best[0]:
            best = (saved, f"sending {send_tokens * bpt / 1e6:.3g} MB to {s.datacenter} ≈ {send * 1e3:.0f} ms "
                           f"{'<' if saved > 0 else '>='} local prefill ≈ {compute * 1e3:.0f} ms")
    if best is None:
        return Gate(False, "; ".join(slow))
    return Gate(best[0] > 0, best[1])
