"""The workloads the chaos scenarios and the soak run under, with the reference of all they send.

    wan       long remote_preferred prompts (streamed and not) and short local ones: KV crosses the WAN
    stream    long streamed answers, so a decode kill lands mid-stream
    overload  long answers that hold decode slots, for 3x capacity
    soak      wan plus multi-turn chats (a chat's second turn reuses the KV its decode already holds)
"""

from __future__ import annotations

from dataclasses import dataclass

from crossfill.config import CrossfillConfig
from crossfill.reliability.reference import References, compute_references, load_tokenizer
from crossfill.reliability.scenarios import Params
from crossfill.reliability.workload import Mix, build_pool

CHAOS_MIXES = ("wan", "stream", "overload")


@dataclass
class Workloads:
    mixes: dict[str, Mix]
    refs: References


def build_workloads(cfg: CrossfillConfig, p: Params, run_id: str, names: tuple[str, ...]) -> Workloads:
    """The mixes `names`, and the greedy reference of every request they can send."""
    tok = load_tokenizer(cfg.model.name)
    limit = cfg.model.max_model_len or 2048  # the smallest context of the models we serve by default
    threshold = cfg.inference_service.routing.long_context_threshold_tokens
    pool = build_pool(tok, threshold, limit, max(p.max_tokens, p.stream_tokens))
    mt, st = p.max_tokens, p.stream_tokens
    wan = (("long", "remote_preferred", False, mt), ("long", "remote_preferred", True, mt),
           ("short", "auto", False, mt), ("long", "remote_preferred", False, mt), ("short", "auto", True, mt))
    patterns = {
        "wan": wan,
        "stream": (("long", "remote_preferred", True, st), ("short", "auto", True, st),
                   ("long", "remote_preferred", False, mt)),
        "overload": (("long", "remote_preferred", False, st), ("long", "remote_preferred", True, st),
                     ("short", "auto", False, st)),
        "soak": (*wan, ("chat", "auto", False, mt), ("chat", "auto", True, mt)),
    }
    mixes = {name: Mix(pool, patterns[name], f"{run_id}-{name}") for name in names}
    return Workloads(mixes, compute_references(cfg.model.name, list(mixes.values()), pool))
