"""API keys: only hashes are stored, lookups find the tenant, a changed keys file is re-read, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crossfill.config import ConfigError, parse_config
from crossfill.security.audit import verify
from crossfill.security.auth import presented_key
from crossfill.security.keys import KeyStore, add_key, client_api_key, hash_key, read_keys_file, revoke_key

DEV_KEY = "dev-key-for-tests-0123456789"


def _cfg(tmp_path: Path, **auth: object) -> object:
    doc = {
        "topology": {"local_datacenter": "here", "gateway": {"port": 18000}, "scheduler": {"port": 18001},
                     "datacenters": {"here": {"prefill": {"port": 18010}, "decode": {"port": 18020, "kv_port": 18030}}}},
        "security": {"dir": str(tmp_path / "sec"), "audit_dir": str(tmp_path / "audit"), "auth": auth},
    }
    return parse_config(doc)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "crossfill.cli", "keys", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_keys_file_holds_hashes_only_and_lookup_finds_the_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    key, rec = add_key(path, "acme", admin=False)
    assert key.startswith("cf-") and len(key) > 40
    text = path.read_text()
    assert key not in text and hash_key(key) in text  # a stolen keys file does not give the key away
    assert json.loads(text)["key_id"] == rec.key_id == hash_key(key)[:12]
    assert os.stat(path).st_mode & 0o077 == 0
    store = KeyStore([], path)
    ident = store.lookup(key)
    assert ident is not None and (ident.tenant, ident.admin, ident.key_id) == ("acme", False, rec.key_id)
    assert store.lookup(key + "x") is None and store.lookup("") is None
    assert store.lookup(hash_key(key)) is None  # the stored hash is not a key


def test_a_key_added_or_revoked_while_running_counts_at_the_next_lookup(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    first, _ = add_key(path, "a")
    store = KeyStore([], path)
    second, rec = add_key(path, "b", admin=True)
    got = store.lookup(second)
    assert got is not None and got.tenant == "b" and got.admin
    revoke_key(path, rec.key_id)
    assert store.lookup(second) is None
    assert store.lookup(first) is not None


def test_dev_keys_and_from_config(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, enabled=True, dev_keys=[{"key": DEV_KEY, "tenant": "dev", "admin": True}])
    store = KeyStore.from_config(cfg)  # type: ignore[arg-type]
    ident = store.lookup(DEV_KEY)
    assert ident is not None and ident.tenant == "dev" and ident.admin
    assert client_api_key(cfg, admin=True) == DEV_KEY  # type: ignore[arg-type]


def test_auth_on_without_any_key_is_a_config_error_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        KeyStore.from_config(_cfg(tmp_path, enabled=True))  # type: ignore[arg-type]
    msg = str(exc.value)
    assert "security.auth" in msg and "dev_keys" in msg and "keys add" in msg and "--no-auth" in msg
    KeyStore.from_config(_cfg(tmp_path, enabled=False))  # type: ignore[arg-type]  # off: no key needed


def test_a_malformed_keys_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    path.write_text('{"tenant": "a", "key_sha256": "00", "admin": false}\n')
    with pytest.raises(ConfigError, match="line 1"):
        read_keys_file(path)


def test_headers_bearer_and_azure_style() -> None:
    assert presented_key({"authorization": "Bearer abc"}) == "abc"
    assert presented_key({"authorization": "bearer  abc "}) == "abc"
    assert presented_key({"authorization": "Basic abc"}) is None
    assert presented_key({"api-key": "k1"}) == "k1"
    assert presented_key({"x-api-key": "k2"}) == "k2"
    assert presented_key({}) is None


def test_cli_add_list_revoke_with_audit(tmp_path: Path) -> None:
    keys = tmp_path / "keys.jsonl"
    doc = _cfg(tmp_path, enabled=True, keys_file=str(keys)).model_dump()  # type: ignore[attr-defined]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(doc))
    out = _cli("add", "acme", "--admin", "--config", str(config))
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()  # the key alone on stdout, printed this once
    assert key.startswith("cf-") and key not in keys.read_text()
    listed = _cli("list", "--keys-file", str(keys))
    assert listed.returncode == 0 and "acme" in listed.stdout and key not in listed.stdout
    kid = read_keys_file(keys)[0].key_id
    assert kid in listed.stdout and hash_key(key) not in listed.stdout
    revoked = _cli("revoke", kid, "--config", str(config))
    assert revoked.returncode == 0, revoked.stderr
    assert read_keys_file(keys) == []
    audit = tmp_path / "audit" / "keys.jsonl"
    events = [json.loads(line)["event"] for line in audit.read_text().splitlines()]
    assert events == ["key_added", "key_revoked"] and verify(audit).ok
    assert key not in audit.read_text()
    assert _cli("revoke", "nosuch", "--keys-file", str(keys)).returncode == 2
    assert _cli("add", "bad tenant!", "--keys-file", str(keys)).returncode == 2


def _serve_scheduler(config: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "crossfill.cli", "serve", "scheduler", "--config", str(config),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_no_key_refuses_to_start_and_no_auth_starts_with_a_loud_warning(tmp_path: Path) -> None:
    from crossfill.security.paths import ensure_symmetric_keys

    doc = _cfg(tmp_path, enabled=True).model_dump()  # type: ignore[attr-defined]
    doc["security"]["tls"]["enabled"] = False  # this test is about keys; the scheduler alone, no certificates
    ensure_symmetric_keys(tmp_path / "sec")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(doc))
    refused = _serve_scheduler(config)
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "security.auth" in out and "--no-auth" in out, out
    proc = _serve_scheduler(config, "--no-auth")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the warning is logged before the server starts listening
            if "AUTHENTICATION IS OFF" in line:
                assert "WARNING" in line
                break
        else:
            raise AssertionError(f"no warning; exit status {proc.wait()}")
    finally:
        proc.terminate()
        proc.wait(60)
