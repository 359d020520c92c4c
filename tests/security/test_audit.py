"""The audit log's hash chain: any edited, removed or reordered line is found, by the library and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from crossfill.security.audit import AuditLog, verify


def _log(tmp_path: Path, n: int = 6) -> Path:
    log = AuditLog(tmp_path / "gateway.jsonl", "gateway")
    for i in range(n):
        log.record("admin_action", path=f"/v1/admin/links/dc{i}", method="POST", outcome="ok")
    return log.path


def _cli(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "crossfill.cli", "audit", "verify", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_intact_log_verifies_and_survives_a_restart(tmp_path: Path) -> None:
    path = _log(tmp_path)
    AuditLog(path, "gateway").record("config_loaded", sha256="ab" * 32)  # a restarted service continues the chain
    v = verify(path)
    assert v.ok and v.lines == 7
    assert v.head == json.loads(path.read_text().splitlines()[-1])["hash"]
    out = _cli(path)
    assert out.returncode == 0 and "ok: 7 lines" in out.stdout


def _rewrite(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


@pytest.mark.parametrize("tamper", ["edit", "remove", "reorder", "insert", "rehash_edit"])
def test_tampering_is_found(tmp_path: Path, tamper: str) -> None:
    path = _log(tmp_path)
    lines = path.read_text().splitlines()
    if tamper == "edit":  # change a field, keep the stored hash
        rec = json.loads(lines[2])
        rec["outcome"] = "denied"
        lines[2] = json.dumps(rec, sort_keys=True, separators=(",", ":"))
    elif tamper == "remove":
        del lines[3]
    elif tamper == "reorder":
        lines[1], lines[2] = lines[2], lines[1]
    elif tamper == "insert":
        lines.insert(2, lines[4])
    else:  # edit a line AND recompute its own hash: the next line no longer follows it
        from crossfill.security.audit import _digest

        rec = json.loads(lines[2])
        rec.pop("hash")
        rec["outcome"] = "denied"
        rec["hash"] = _digest(rec["prev"], rec)
        lines[2] = json.dumps(rec, sort_keys=True, separators=(",", ":"))
    _rewrite(path, lines)
    v = verify(path)
    assert not v.ok and v.problem is not None
    out = _cli(path)
    assert out.returncode == 1 and "TAMPERED" in out.stderr


def test_a_log_whose_last_line_is_garbage_is_not_extended(tmp_path: Path) -> None:
    path = _log(tmp_path, 2)
    with path.open("a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match="audit verify"):
        AuditLog(path, "gateway")


def test_each_service_start_records_the_config_and_its_security_switches(tmp_path: Path) -> None:
    import yaml

    from crossfill.config import parse_config
    from crossfill.security.audit import open_audit

    data = yaml.safe_load(Path("examples/two-dc.yaml").read_text())
    data["security"] = {**data.get("security", {}), "audit_dir": str(tmp_path)}
    cfg = parse_config(data, "two-dc.yaml")
    open_audit(cfg, "gateway")
    data["security"] |= {"auth": {**data["security"].get("auth", {}), "enabled": False}, "tls": {"enabled": False}}
    relaxed = parse_config(data, "two-dc.yaml")
    open_audit(relaxed, "gateway")  # a restart with auth and TLS turned off is on the record
    records = [json.loads(line) for line in (tmp_path / "gateway.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["config_loaded", "config_loaded"]
    first, second = records
    assert (first["auth"], first["tls"], first["tickets"], first["kv_encryption"]) == (True, True, True, True)
    assert (second["auth"], second["tls"]) == (False, False)
    assert first["config_sha256"] != second["config_sha256"]
    assert first["limits_sha256"] == second["limits_sha256"]
    assert "crossfill-demo-key" not in (tmp_path / "gateway.jsonl").read_text()  # dev keys stay out
    assert verify(tmp_path / "gateway.jsonl").ok
