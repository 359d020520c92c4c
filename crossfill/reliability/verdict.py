"""Judging requests against the reference, and the table row of a scenario (or a soak run).

Columns: sent = completed + failed + lost. Among what the client saw (completed answers, and the
tokens a stream delivered before an explicit error):
- duplicated: an answer given twice (two final chunks, data after [DONE], the same request id
  answered twice) or tokens that repeat part of the stream (a retry replayed from the start);
- wrong: anything else that differs from the greedy reference (a partial stream must be a prefix).
leaked: KV blocks still in use on the workers once every request has ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from crossfill.reliability.client import Outcome
from crossfill.reliability.reference import References

COLUMNS = ("scenario", "sent", "completed", "failed", "lost", "duplicated", "wrong", "leaked", "notes")


def _repeats_part(got: Sequence[Any], want: Sequence[Any]) -> bool:
    """`got` went along `want`, then started over from an earlier point of it (a replayed stream)."""
    p = 0
    while p < min(len(got), len(want)) and got[p] == want[p]:
        p += 1
    rest = got[p:]
    if not rest or p == 0:
        return False
    for q in range(p):
        tail = want[q:q + len(rest)]
        if list(rest[:len(tail)]) == list(tail):
            return True
    return False


def judge(out: Outcome, refs: References) -> str | None:
    """'duplicated', 'wrong' or None (right) for what the client saw of `out`."""
    if out.finals > 1 or out.after_done:
        return "duplicated"
    if out.verdict == "lost":
        return None
    want = refs.get(out.spec.ref_key)
    if want is None:
        raise KeyError(f"no reference for {out.spec.ref_key}: the workload sent a shape it did not declare")
    chat = out.spec.prompt.is_chat
    got_seq: Sequence[Any] = out.text if chat else out.token_ids
    want_seq: Sequence[Any] = want.text if chat else want.token_ids
    if out.verdict == "completed":
        if list(got_seq) == list(want_seq):
            return None
        if len(got_seq) > len(want_seq) or (out.completion_tokens or 0) > out.spec.max_tokens:
            return "duplicated"
        return "duplicated" if _repeats_part(got_seq, want_seq) else "wrong"
    # failed: whatever streamed before the explicit error must be the start of the right answer
    if list(got_seq) == list(want_seq[:len(got_seq)]):
        return None
    return "duplicated" if _repeats_part(got_seq, want_seq) else "wrong"


@dataclass
class Row:
    scenario: str
    sent: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    leaked: int | None = 0  # None: could not be measured (a worker never answered)
    notes: str = ""
    skipped: str | None = None
    error: str | None = None  # the scenario itself could not be carried out
    errors: dict[str, int] | None = None
    examples: list[str] | None = None  # first few lost/wrong/duplicated (then failed) requests, for the report

    @property
    def ok(self) -> bool:
        if self.skipped:
            return True
        return (self.error is None and self.lost == 0 and self.duplicated == 0 and self.wrong == 0
                and self.leaked == 0)

    def cells(self) -> list[str]:
        if self.skipped:
            return [self.scenario, *["-"] * 7, f"skipped: {self.skipped}"]
        leaked = "?" if self.leaked is None else str(self.leaked)
        notes = f"ERROR: {self.error}; {self.notes}" if self.error else self.notes
        return [self.scenario, str(self.sent), str(self.completed), str(self.failed), str(self.lost),
                str(self.duplicated), str(self.wrong), leaked, notes]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def tally(scenario: str, outcomes: list[Outcome], refs: References, leaked: int | None, note: str = "") -> Row:
    row = Row(scenario, sent=len(outcomes), leaked=leaked)
    seen: Counter[str] = Counter(o.spec.request_id for o in outcomes)
    errors: Counter[str] = Counter()
    examples: list[str] = []
    failures: list[str] = []
    for o in outcomes:
        setattr(row, o.verdict, getattr(row, o.verdict) + 1)
        if o.verdict == "failed":
            errors[o.error_code or "?"] += 1
        bad = judge(o, refs) or ("duplicated" if seen[o.spec.request_id] > 1 else None)
        if bad:
            setattr(row, bad, getattr(row, bad) + 1)
        if (bad or o.verdict == "lost") and len(examples) < 5:
            examples.append(f"{o.spec.request_id} {bad or 'lost'}: {o.detail or o.status}")
        elif o.verdict == "failed" and len(failures) < 3:
            failures.append(f"{o.spec.request_id} failed: {o.detail}")
    degraded = sum(bool(o.route and o.route.get("degradation_reason")) for o in outcomes if o.verdict == "completed")
    remote = sum(bool(o.route and o.route.get("route") == "remote") for o in outcomes if o.verdict == "completed")
    retries = sum(o.connect_retries for o in outcomes)
    chats = sum(o.spec.prompt.is_chat for o in outcomes)
    parts = [note] if note else []
    parts.append(f"remote {remote}, degraded {degraded}" + (f", chat turns {chats}" if chats else ""))
    if errors:
        parts.append("errors " + ", ".join(f"{k}×{v}" for k, v in errors.most_common()))
    if retries:
        parts.append(f"client connect retries {retries}")
    row.notes, row.errors, row.examples = "; ".join(parts), dict(errors), examples + failures
    return row


def render_text(rows: list[Row]) -> str:
    table = [list(COLUMNS)] + [r.cells() for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
    lines = []
    for line in table:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths,
                                                                                          strict=False)))
                     + "  " + line[-1])
    return "\n".join(lines)


def render_markdown(rows: list[Row]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * 7 + ["---"]) + "|"]
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in r.cells()) + " |")
    return "\n".join(out) + "\n"
