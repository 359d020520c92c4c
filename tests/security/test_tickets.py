"""Transfer tickets as a library, with a test clock: signing, every refusal reason, rotation, replay.

The live half (a real cluster refusing unticketed prefill jobs and KV) is test_tickets_live.py.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from crossfill.config import ConfigError
from crossfill.kv.assembler import Assembly, Counters, Expectation
from crossfill.kv.errors import Reason, WireError
from crossfill.kv.wire import Manifest
from crossfill.security.paths import TICKET_KEYS, ensure_symmetric_keys
from crossfill.security.tickets import (
    REASONS,
    TicketKeys,
    TicketRefused,
    TicketSigner,
    TicketVerifier,
    add_key,
    drop_key,
    set_current,
)

TTL = 120.0


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    ensure_symmetric_keys(tmp_path)
    return tmp_path


def _parts(tmp: Path, clock: Clock, max_retry: int = 1) -> tuple[TicketSigner, TicketVerifier]:
    keys = TicketKeys(tmp / TICKET_KEYS)
    return TicketSigner(keys, TTL, clock), TicketVerifier(TicketKeys(tmp / TICKET_KEYS), max_retry, clock)


def _sign(signer: TicketSigner, **kw: object) -> str:
    args = {"request_id": "req-1", "tenant": "acme", "decode": "here-decode-0",
            "prefills": ("far-prefill-0", "here-prefill-0"), **kw}
    return signer.sign(**args)  # type: ignore[arg-type]


def _refused(verifier: TicketVerifier, token: str | None, **kw: object) -> str:
    args = {"tenant": "acme", "decode": "here-decode-0", "prefill": "far-prefill-0", "cache_id": "req-1.aaaa", **kw}
    with pytest.raises(TicketRefused) as e:
        verifier.verify(token, **args)  # type: ignore[arg-type]
    assert e.value.reason in REASONS
    return e.value.reason


def _forge(token: str, **changes: object) -> str:
    """The ticket with its payload edited and the original signature kept."""
    body, mac = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload.update(changes)
    new = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).rstrip(b"=").decode()
    return f"{new}.{mac}"


def test_a_signed_ticket_verifies_for_every_prefill_of_its_route(keydir: Path) -> None:
    clock = Clock()
    signer, verifier = _parts(keydir, clock)
    token = _sign(signer)
    assert len(token) < 600 and token.count(".") == 1
    t = verifier.verify(token, tenant="acme", decode="here-decode-0", prefill="far-prefill-0", cache_id="req-1.a")
    assert (t.request_id, t.tenant, t.decode, t.prefills) == ("req-1", "acme", "here-decode-0",
                                                             ("far-prefill-0", "here-prefill-0"))
    assert t.expires_at == clock.now + TTL
    # The fallback, with its own cache id; and decode's check of the job itself (no cache id).
    verifier.verify(token, tenant="acme", decode="here-decode-0", prefill="here-prefill-0", cache_id="req-1.b")
    verifier.verify(token, tenant="acme", decode="here-decode-0")
    # No tenant is the empty tenant, on both sides.
    verifier.verify(_sign(signer, tenant=""), tenant="", decode="here-decode-0", cache_id="req-1.c")


def test_each_refusal_reason(keydir: Path) -> None:
    clock = Clock()
    signer, verifier = _parts(keydir, clock)
    token = _sign(signer)
    body, mac = token.split(".")
    assert _refused(verifier, None) == "missing"
    assert _refused(verifier, "") == "missing"
    assert _refused(verifier, "not-a-ticket") == "malformed"
    assert _refused(verifier, "a.b.c") == "malformed"
    assert _refused(verifier, f"{body}!.{mac}") == "malformed"
    assert _refused(verifier, "x" * 5000 + "." + mac) == "malformed"
    assert _refused(verifier, f"{body}.{mac[:-2]}AA") == "bad_signature"
    # Altered content under the original signature: the tenant, the route, the request.
    assert _refused(verifier, _forge(token, ten="other"), tenant="other") == "bad_signature"
    assert _refused(verifier, _forge(token, pre=["evil-prefill"]), prefill="evil-prefill") == "bad_signature"
    assert _refused(verifier, _forge(token, exp=clock.now + 10 * TTL)) == "bad_signature"
    assert _refused(verifier, _forge(token, kid="nope")) == "unknown_key"
    assert _refused(verifier, token, tenant="other") == "wrong_tenant"
    assert _refused(verifier, token, decode="here-decode-1") == "wrong_decode"
    assert _refused(verifier, token, prefill="far-prefill-1") == "wrong_prefill"
    assert _refused(verifier, token, cache_id="req-2.aaaa") == "wrong_cache_id"
    assert _refused(verifier, token, cache_id="req-1") == "wrong_cache_id"
    assert _refused(verifier, token, cache_id="req-1.") == "wrong_cache_id"
    assert _refused(verifier, token, cache_id="req-10.aaaa") == "wrong_cache_id"
    clock.now += TTL - 0.001
    verifier.verify(token, tenant="acme", decode="here-decode-0", prefill="far-prefill-0", cache_id="req-1.ok")
    clock.now += 0.001
    assert _refused(verifier, token) == "expired"


def test_a_ticket_signed_with_another_deployments_key_is_refused(keydir: Path, tmp_path_factory) -> None:
    other = tmp_path_factory.mktemp("other")
    ensure_symmetric_keys(other)
    clock = Clock()
    theirs, _ = _parts(other, clock)
    _, ours = _parts(keydir, clock)
    assert _refused(ours, _sign(theirs)) == "unknown_key"
    # The same key id with a different key is a bad signature, not a pass.
    doc = json.loads((keydir / TICKET_KEYS).read_text())
    kid = doc["current"]
    mine = json.loads((other / TICKET_KEYS).read_text())
    (other / TICKET_KEYS).write_text(json.dumps({"current": kid, "keys": {kid: next(iter(mine["keys"].values()))}}))
    theirs, _ = _parts(other, clock)
    assert _refused(ours, _sign(theirs)) == "bad_signature"


def test_replay_of_a_cache_id_and_more_attempts_than_the_route_allows(keydir: Path) -> None:
    clock = Clock()
    signer, verifier = _parts(keydir, clock, max_retry=1)
    token = _sign(signer)  # two prefills, max_retry 1: four attempts at most
    verifier.verify(token, tenant="acme", decode="here-decode-0", prefill="far-prefill-0", cache_id="req-1.a")
    assert _refused(verifier, token, cache_id="req-1.a") == "replayed"
    for suffix in "bcd":
        verifier.verify(token, tenant="acme", decode="here-decode-0", prefill="far-prefill-0",
                        cache_id=f"req-1.{suffix}")
    assert _refused(verifier, token, cache_id="req-1.e") == "replayed"
    # Another ticket of the same request (routed again) has its own nonce and budget.
    verifier.verify(_sign(signer), tenant="acme", decode="here-decode-0", prefill="far-prefill-0",
                    cache_id="req-1.e")
    # Uses are forgotten when their ticket expires (it is refused as expired from then on anyway).
    assert verifier.remembered() == 2
    clock.now += TTL
    verifier.verify(_sign(signer), tenant="acme", decode="here-decode-0", cache_id="req-1.f")
    assert verifier.remembered() == 1
    # The job check at decode (no cache id) records nothing.
    verifier.verify(token := _sign(signer), tenant="acme", decode="here-decode-0")
    verifier.verify(token, tenant="acme", decode="here-decode-0")
    assert verifier.remembered() == 1


def test_rotation_new_key_signs_old_key_verifies_until_dropped(keydir: Path) -> None:
    clock = Clock()
    signer, verifier = _parts(keydir, clock)
    path = keydir / TICKET_KEYS
    before = _sign(signer)
    old_kid = json.loads(path.read_text())["current"]
    new_kid = add_key(keydir)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    _bump(path)
    after = _sign(signer)  # the running signer picked up the new current key
    assert json.loads(base64.urlsafe_b64decode(after.split(".")[0] + "==="))["kid"] == new_kid
    for i, token in enumerate((before, after)):
        verifier.verify(token, tenant="acme", decode="here-decode-0", cache_id=f"req-1.{i}")
    drop_key(keydir, old_kid)
    _bump(path)
    assert _refused(verifier, before, cache_id="req-1.x") == "unknown_key"
    verifier.verify(after, tenant="acme", decode="here-decode-0", cache_id="req-1.y")
    with pytest.raises(ConfigError, match="current"):
        drop_key(keydir, new_kid)


def test_rotation_across_hosts_adds_the_key_everywhere_before_signing_with_it(keydir: Path) -> None:
    clock = Clock()
    signer, verifier = _parts(keydir, clock)
    old_kid = json.loads((keydir / TICKET_KEYS).read_text())["current"]
    kid = add_key(keydir, current=False)  # step 1: accepted by verifiers, not used by the signer yet
    _bump(keydir / TICKET_KEYS)
    token = _sign(signer)
    assert json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "==="))["kid"] == old_kid
    set_current(keydir, kid)  # step 2
    _bump(keydir / TICKET_KEYS)
    token = _sign(signer)
    assert json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "==="))["kid"] == kid
    verifier.verify(token, tenant="acme", decode="here-decode-0", cache_id="req-1.a")
    with pytest.raises(ConfigError, match="no ticket key"):
        set_current(keydir, "nope")


def test_a_broken_key_file_is_a_config_error_at_start_and_ignored_when_rotated_in(keydir: Path) -> None:
    path = keydir / TICKET_KEYS
    signer, verifier = _parts(keydir, Clock())
    token = _sign(signer)
    path.write_text('{"current": "k", "keys": {}}')
    with pytest.raises(ConfigError, match="current key 'k'"):
        TicketKeys(path)
    path.write_text('{"current": "k", "keys": {"k": "abcd"}}')
    with pytest.raises(ConfigError, match="shorter"):
        TicketKeys(path)
    path.write_text("not json")
    with pytest.raises(ConfigError, match="tickets.json"):
        TicketKeys(path)
    _bump(path)
    # A running verifier keeps the keys it had rather than refusing everything.
    verifier.verify(token, tenant="acme", decode="here-decode-0", cache_id="req-1.z")
    path.unlink()
    with pytest.raises(ConfigError, match="certs init"):
        TicketKeys(path)


def _bump(path: Path) -> None:
    """Make a rewrite visible even when it lands within the file system's timestamp granularity."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


# --------------------------------------------------------------------------- the receiver's hook


def _manifest(ticket: str | None, cache_id: str = "req-1.aaaa") -> Manifest:
    return Manifest(cache_id=cache_id, request_id="req-1", tenant="acme", fingerprint="f" * 64,
                    token_digest="d" * 64, num_tokens=0, codec="none", frame_tokens=16, expires_at=4e9,
                    layers=(), ticket=ticket)


async def test_the_assembler_refuses_a_manifest_its_authorize_hook_refuses_without_failing_the_transfer() -> None:
    def authorize(m: Manifest) -> None:
        if m.ticket != "good":
            raise WireError(Reason.TICKET, f"wrong_cache_id: {m.ticket}")

    async def sink(_: object) -> None:
        return None

    a = Assembly(Expectation("req-1.aaaa", sink, tenant="acme", authorize=authorize), Counters())
    touched = a.last_activity
    for bad in (None, "forged"):
        with pytest.raises(WireError) as e:
            a.accept_manifest(_manifest(bad))
        assert e.value.reason is Reason.TICKET
    # Still waiting for the permitted sender, and the refused ones did not keep it alive.
    assert not a.finished and a.manifest is None and a.last_activity == touched
    assert a.counters.as_dict()["refused_ticket"] == 2
    a.accept_manifest(_manifest("good"))
    assert a.manifest is not None
    with pytest.raises(WireError) as e:  # another stream with another ticket for the same cache id
        a.accept_manifest(_manifest("forged"))
    assert e.value.reason is Reason.DUPLICATE


def test_manifest_wire_form_without_a_ticket_is_unchanged_and_with_one_round_trips() -> None:
    plain = _manifest(None)
    assert b"ticket" not in plain.to_json()
    assert Manifest.from_json(plain.to_json()) == plain
    signed = _manifest("abc.def")
    assert Manifest.from_json(signed.to_json()).ticket == "abc.def"
    doc = json.loads(signed.to_json())
    doc["ticket"] = "x" * 5000
    with pytest.raises(WireError, match="ticket"):
        Manifest.from_json(json.dumps(doc).encode())


def test_a_rewrite_that_keeps_size_and_timestamp_is_still_picked_up(keydir: Path, monkeypatch) -> None:
    path = keydir / TICKET_KEYS
    keys = TicketKeys(path)
    st = path.stat()
    kid = add_key(keydir, current=False)
    set_current(keydir, kid)
    doc = json.loads(path.read_text())
    # Same length and timestamp as before (a coarse clock): only the periodic re-read sees it.
    old_kid = keys.current
    path.write_text(json.dumps({"current": kid, "keys": {kid: doc["keys"][kid]}}))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(keys, "_stamp", keys._stat())
    monkeypatch.setattr(TicketKeys, "RECHECK_S", 1e9)
    keys.refresh()
    assert keys.current == old_kid  # within RECHECK_S of the last look: not re-read yet
    monkeypatch.setattr(TicketKeys, "RECHECK_S", 0.0)
    keys.refresh()
    assert keys.current == kid and set(keys.keys) == {kid}


def _ticket_cli(*args: str) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "crossfill.cli", "certs", "ticket-key", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_rotation_cli_adds_switches_and_drops_keys(keydir: Path) -> None:
    clock = Clock()
    signer, verifier = _parts(keydir, clock)
    old = _ticket_cli("list", str(keydir)).split()[0]
    before = _sign(signer)
    new = _ticket_cli("add", str(keydir), "--no-current").strip()
    assert _ticket_cli("list", str(keydir)).splitlines() == sorted([f"{old}  current", new])
    _ticket_cli("use", str(keydir), new)
    _ticket_cli("drop", str(keydir), old)
    _bump(keydir / TICKET_KEYS)
    assert _refused(verifier, before) == "unknown_key"  # the dropped key's tickets stop verifying
    verifier.verify(_sign(signer), tenant="acme", decode="here-decode-0", cache_id="req-1.b")
    assert bytes.fromhex(json.loads((keydir / TICKET_KEYS).read_text())["keys"][new]).hex() not in \
        _ticket_cli("list", str(keydir))  # ids only, never key material
