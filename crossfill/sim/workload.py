"""The simulated requests: an arrival process, prompt and output lengths, shared prefixes, multi-turn
sessions and the request mix, drawn once per seed so every strategy sees the same arrivals.

`Requests` keeps one flat list per field (no object per request): a million requests are a few
lists of ints and floats, and the simulator indexes them by request number.

Prefix keys: a request may carry one cache key (an int). Shared prefixes are keys 0..K-1: the
first `tokens` tokens of the prompt are a system prompt / template that K variants share. A
session's turns share key K + session number: turn n+1's prompt starts with turn n's prompt and
answer, so an instance that served turn n holds part of it (prefill: the prompt; decode: prompt
and answer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from crossfill.planner.workload import EmpiricalWorkload, LogNormalWorkload, Workload

Process = str  # "poisson" | "gamma" | "fixed"
ARRIVAL_PROCESSES = ("poisson", "gamma", "fixed")


@dataclass(frozen=True)
class Arrival:
    process: Process = "poisson"
    rate: float = 1.0  # new requests (or conversations) per second
    cv: float = 1.0  # gamma: coefficient of variation of inter-arrival times (> 1 is bursty)


@dataclass(frozen=True)
class Lengths:
    """A token-count distribution: a constant, or a planner workload (log-normal or empirical)."""

    fixed: int | None = None
    dist: Workload | None = None

    def mean(self) -> float:
        return float(self.fixed) if self.fixed is not None else float(self.dist.mean())  # type: ignore[union-attr]

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.fixed is not None:
            return np.full(n, self.fixed, dtype=np.int64)
        if isinstance(self.dist, EmpiricalWorkload):
            return np.round(rng.choice(self.dist.lengths, size=n)).astype(np.int64).clip(min=1)
        assert isinstance(self.dist, LogNormalWorkload)
        return _truncated_lognormal(self.dist, n, rng)


def _truncated_lognormal(w: LogNormalWorkload, n: int, rng: np.random.Generator) -> np.ndarray:
    """ln L ~ N(mu, sigma) restricted to [lo, hi] by inverse-CDF sampling of the normal, which stays
    exact however little mass [lo, hi] holds (rejection sampling would not finish)."""
    nd = NormalDist()
    a = nd.cdf((math.log(w.lo) - w.mu) / w.sigma)
    b = 1.0 if math.isinf(w.hi) else nd.cdf((math.log(w.hi) - w.mu) / w.sigma)
    u = rng.uniform(a, b, size=n).clip(1e-300, 1 - 1e-16)
    z = np.fromiter((nd.inv_cdf(float(x)) for x in u), dtype=float, count=n)
    return np.round(np.exp(w.mu + w.sigma * z)).clip(max(1.0, math.ceil(w.lo)), w.hi).astype(np.int64)


@dataclass(frozen=True)
class PrefixSharing:
    share: float  # of requests (outside sessions) that start with one of the shared prefixes
    prefixes: int  # how many distinct shared prefixes (equally popular)
    tokens: int  # length of each


@dataclass(frozen=True)
class Sessions:
    share: float  # of new arrivals that open a multi-turn conversation
    turns: int  # turns per conversation (the first included)
    think_s: float  # mean time between a turn's arrival and the next (exponential)
    new_tokens: int  # tokens the user adds each turn


@dataclass(frozen=True)
class WorkloadSpec:
    arrival: Arrival
    lengths: Lengths
    output: Lengths
    prefix: PrefixSharing | None = None
    sessions: Sessions | None = None
    batch_share: float = 0.0
    tenants: tuple[tuple[str, float], ...] = ()  # tenant id -> share of requests


@dataclass
class Requests:
    arrival: list[float] = field(default_factory=list)  # seconds, increasing
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    key: list[int] = field(default_factory=list)  # cache key, -1 none
    prefix_len: list[int] = field(default_factory=list)  # tokens of the prompt a holder of `key` can match
    put_prefill: list[int] = field(default_factory=list)  # tokens a prefill instance caches under `key`
    put_decode: list[int] = field(default_factory=list)  # tokens the decode instance keeps under `key`
    rtype: list[str | None] = field(default_factory=list)  # "batch", "interactive" or None (tenant default)
    tenant: list[str | None] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.arrival)

    def scaled(self, factor: float) -> Requests:
        """The same requests arriving `factor` times faster (a trace replayed at a higher rate)."""
        out = Requests(**{k: list(v) if isinstance(v, list) else v for k, v in self.__dict__.items()})
        out.arrival = [t / factor for t in self.arrival]
        return out

    def mean_prompt(self) -> float:
        return sum(self.prompt) / max(len(self.prompt), 1)


def generate(spec: WorkloadSpec, n: int, seed: int) -> Requests:
    """`n` requests drawn from `spec` with `seed` (numpy's PCG64: same seed, same requests)."""
    rng = np.random.default_rng(seed)
    sessions = spec.sessions
    extra = sessions.share * (sessions.turns - 1) if sessions else 0.0
    n_base = int(math.ceil(n / (1.0 + extra))) + 8
    gaps = _gaps(spec.arrival, n_base, rng)
    base_t = np.cumsum(gaps)
    prompt = spec.lengths.sample(n_base, rng)
    output = spec.output.sample(n_base, rng)
    key = np.full(n_base, -1, dtype=np.int64)
    prefix_len = np.zeros(n_base, dtype=np.int64)
    put_prefill = np.zeros(n_base, dtype=np.int64)
    put_decode = np.zeros(n_base, dtype=np.int64)
    opens_session = rng.random(n_base) < (sessions.share if sessions else 0.0)
    if spec.prefix is not None:
        p = spec.prefix
        shared = (~opens_session) & (rng.random(n_base) < p.share)
        key[shared] = rng.integers(0, p.prefixes, size=int(shared.sum()))
        # At least one token of every prompt is its own (a prompt is never only the template).
        prefix_len[shared] = np.minimum(p.tokens, prompt[shared] - 1)
        put_prefill[shared] = prefix_len[shared]
        put_decode[shared] = prefix_len[shared]
    cols = [base_t, prompt, output, key, prefix_len, put_prefill, put_decode]
    if sessions is not None and opens_session.any():
        cols = _add_session_turns(spec, sessions, cols, opens_session, rng)
    order = np.argsort(cols[0], kind="stable")[:n]
    t, prompt, output, key, prefix_len, put_prefill, put_decode = (c[order] for c in cols)
    rtype = np.where(rng.random(len(order)) < spec.batch_share, "batch", "")
    tenant = _tenants(spec.tenants, len(order), rng)
    return Requests(
        arrival=t.tolist(), prompt=prompt.tolist(), output=output.tolist(), key=key.tolist(),
        prefix_len=prefix_len.tolist(), put_prefill=put_prefill.tolist(), put_decode=put_decode.tolist(),
        rtype=[x or None for x in rtype.tolist()], tenant=tenant, source="synthetic",
    )


def _gaps(arrival: Arrival, n: int, rng: np.random.Generator) -> np.ndarray:
    mean = 1.0 / arrival.rate
    if arrival.process == "fixed":
        return np.full(n, mean)
    if arrival.process == "gamma":
        shape = 1.0 / (arrival.cv * arrival.cv)
        return rng.gamma(shape, mean / shape, size=n)
    return rng.exponential(mean, size=n)


def _add_session_turns(spec: WorkloadSpec, s: Sessions, cols: list[np.ndarray], opens: np.ndarray,
                       rng: np.random.Generator) -> list[np.ndarray]:
    """Follow-up turns of every conversation: each prompt is the previous prompt, its answer and
    `new_tokens` more; a conversation ends early when its prompt would leave the length range."""
    t, prompt, output, key, prefix_len, put_prefill, put_decode = (c.copy() for c in cols)
    first_key = spec.prefix.prefixes if spec.prefix is not None else 0
    starters = np.flatnonzero(opens)
    key[starters] = first_key + np.arange(starters.size)
    put_prefill[starters] = prompt[starters]
    put_decode[starters] = prompt[starters] + output[starters]
    hi = spec.lengths.dist.hi if spec.lengths.dist is not None else math.inf
    think = rng.exponential(s.think_s, size=(starters.size, s.turns - 1))
    outs = spec.output.sample(starters.size * (s.turns - 1), rng).reshape(starters.size, s.turns - 1)
    rows: list[tuple[float, int, int, int, int, int, int]] = []
    for j, i in enumerate(starters.tolist()):
        at, p, o, k = float(t[i]), int(prompt[i]), int(output[i]), int(key[i])
        for turn in range(s.turns - 1):
            held = p + o
            p = held + s.new_tokens
            if p > hi:
                break
            at += float(think[j, turn])
            o = int(outs[j, turn])
            rows.append((at, p, o, k, held, p, p + o))
    if not rows:
        return [t, prompt, output, key, prefix_len, put_prefill, put_decode]
    extra = np.asarray(rows)
    base = [t, prompt, output, key, prefix_len, put_prefill, put_decode]
    return [np.concatenate([b, extra[:, c].astype(b.dtype)]) for c, b in enumerate(base)]


def _tenants(mix: tuple[tuple[str, float], ...], n: int, rng: np.random.Generator) -> list[str | None]:
    if not mix:
        return [None] * n
    names = [name for name, _ in mix] + [None]
    shares = [share for _, share in mix]
    probs = np.asarray(shares + [max(0.0, 1.0 - sum(shares))])
    picks = rng.choice(len(names), size=n, p=probs / probs.sum())
    return [names[i] for i in picks.tolist()]
