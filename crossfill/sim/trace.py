"""`--trace FILE`: requests replayed from a CSV (header row) or JSONL file, one request a row.

Columns: `time` (or `arrival_s`, seconds, strictly increasing), `prompt_tokens`, `output_tokens`;
optional `prefix_id` with `prefix_tokens` (a shared prefix of that many tokens), `session_id`
(rows of one conversation: each prompt starts with the previous turn's prompt and answer),
`tenant_id` and `request_type` (interactive | batch). A bad row is refused with its number and
the column, never skipped: a silently shortened trace would be a different experiment.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from crossfill.policy import REQUEST_TYPES
from crossfill.sim.errors import SimError
from crossfill.sim.workload import Requests

_COLUMNS = {"time", "arrival_s", "prompt_tokens", "output_tokens", "prefix_id", "prefix_tokens", "session_id",
            "tenant_id", "request_type"}


def load_trace(path: str | Path) -> Requests:
    p = Path(path)
    if not p.is_file():
        raise SimError(f"--trace: file {p} does not exist; expected a CSV or JSONL trace")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SimError(f"--trace: cannot read {p} ({exc})") from None
    rows = _jsonl_rows(p, text) if p.suffix in (".jsonl", ".json", ".ndjson") else _csv_rows(p, text)
    if not rows:
        raise SimError(f"--trace: {p} holds no requests")
    return _requests(p, rows)


def _csv_rows(p: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip() and not line.startswith("#")]
    if not lines:
        return []
    reader = csv.reader([line for _, line in lines])
    header = [h.strip() for h in next(reader)]
    unknown = sorted(set(header) - _COLUMNS)
    if unknown:
        raise SimError(f"--trace: {p} line {lines[0][0]}: unknown columns {unknown}; expected some of {sorted(_COLUMNS)}")
    out = []
    for (lineno, _), cells in zip(lines[1:], reader, strict=False):
        out.append((lineno, {h: c.strip() for h, c in zip(header, cells, strict=False) if c.strip() != ""}))
    return out


def _jsonl_rows(p: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SimError(f"--trace: {p} line {i + 1}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise SimError(f"--trace: {p} line {i + 1}: expected a JSON object per line")
        unknown = sorted(set(row) - _COLUMNS)
        if unknown:
            raise SimError(f"--trace: {p} line {i + 1}: unknown fields {unknown}; expected some of {sorted(_COLUMNS)}")
        out.append((i + 1, row))
    return out


def _requests(p: Path, rows: list[tuple[int, dict[str, Any]]]) -> Requests:
    req = Requests(source=str(p))
    keys: dict[str, int] = {}
    sessions: dict[str, tuple[int, int, int]] = {}  # session -> (key, last prompt, last output)
    last_t = -math.inf
    for n, (lineno, row) in enumerate(rows, start=1):
        where = f"--trace: {p} row {n} (line {lineno})"
        t = _number(row, ("time", "arrival_s"), where)
        if t < 0 or t <= last_t:
            raise SimError(f"{where}: time {t:g} must be >= 0 and greater than the previous row's {last_t:g}; "
                           "expected strictly increasing arrival times")
        last_t = t
        prompt = _count(row, "prompt_tokens", where)
        output = _count(row, "output_tokens", where)
        rtype = row.get("request_type")
        if rtype is not None and rtype not in REQUEST_TYPES:
            raise SimError(f"{where}: request_type {rtype!r} is unknown; expected one of {list(REQUEST_TYPES)}")
        key, prefix_len, put_p, put_d = -1, 0, 0, 0
        if row.get("session_id") not in (None, ""):
            sid = str(row["session_id"])
            if sid in sessions:
                key, prev_p, prev_o = sessions[sid]
                prefix_len = min(prev_p + prev_o, prompt - 1)
            else:
                key = keys.setdefault(f"session:{sid}", len(keys))
            put_p, put_d = prompt, prompt + output
            sessions[sid] = (key, prompt, output)
        elif row.get("prefix_id") not in (None, ""):
            if "prefix_tokens" not in row:
                raise SimError(f"{where}: prefix_tokens is missing; a row with prefix_id needs the prefix's length")
            tokens = _count(row, "prefix_tokens", where)
            key = keys.setdefault(f"prefix:{row['prefix_id']}", len(keys))
            prefix_len = put_p = put_d = min(tokens, prompt - 1)
        req.arrival.append(t)
        req.prompt.append(prompt)
        req.output.append(output)
        req.key.append(key)
        req.prefix_len.append(max(prefix_len, 0))
        req.put_prefill.append(max(put_p, 0))
        req.put_decode.append(max(put_d, 0))
        req.rtype.append(rtype)
        tenant = row.get("tenant_id")
        req.tenant.append(None if tenant in (None, "") else str(tenant))
    return req


def _number(row: dict[str, Any], names: tuple[str, ...], where: str) -> float:
    for name in names:
        if name in row:
            try:
                value = float(row[name])
            except (TypeError, ValueError):
                raise SimError(f"{where}: {name} {row[name]!r} is not a number of seconds") from None
            if not math.isfinite(value):
                raise SimError(f"{where}: {name} must be a finite number of seconds")
            return value
    raise SimError(f"{where}: {' or '.join(names)} is missing; expected the arrival time in seconds")


def _count(row: dict[str, Any], name: str, where: str) -> int:
    if name not in row:
        raise SimError(f"{where}: {name} is missing; expected a whole number of tokens > 0")
    raw = row[name]
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise SimError(f"{where}: {name} {raw!r} is not a number; expected a whole number of tokens > 0") from None
    if not value > 0 or value != int(value):
        raise SimError(f"{where}: {name} {raw!r} must be a whole number of tokens > 0")
    return int(value)
