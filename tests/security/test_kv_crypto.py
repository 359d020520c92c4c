"""KV sealing (crossfill.security.kv_crypto): per-tenant keys, binding to cache id and key, rotation."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography.exceptions import InvalidTag

from crossfill.config import ConfigError, SecurityConfig
from crossfill.security import kv_crypto
from crossfill.security.kv_crypto import (
    HEADER,
    KVCipher,
    SealError,
    load_cipher,
    parse_master_keys,
    tenant_key,
)
from crossfill.security.paths import KV_MASTER_KEY, ensure_symmetric_keys

MASTER = bytes(range(32))
KV = os.urandom(4096)  # stands in for a frame of KV
NAMES = {"tenant": "tenant-a", "cache_id": "cache-A", "key": "kv/cache-A/f/0"}


def _windows(data: bytes, width: int = 32) -> list[bytes]:
    return [data[i : i + width] for i in range(0, len(data) - width, 97)]


def test_sealed_object_opens_only_as_what_it_was_written_as() -> None:
    c = KVCipher([MASTER])
    blob = c.seal(KV, **NAMES)
    assert c.open(blob, **NAMES) == KV
    assert len(blob) == len(KV) + kv_crypto.OVERHEAD
    assert not any(w in blob for w in _windows(KV))  # ciphertext: no 32-byte window of the plaintext
    assert c.seal(KV, **NAMES) != blob  # a fresh nonce per object


def test_a_tenants_key_cannot_open_another_tenants_object() -> None:
    c = KVCipher([MASTER])
    blob = c.seal(KV, **NAMES)
    assert tenant_key(MASTER, "tenant-a") != tenant_key(MASTER, "tenant-b")
    # The raw AEAD of tenant-b, even with the right nonce and associated data, refuses it.
    _, _, _, nonce = HEADER.unpack(blob[: HEADER.size])
    ad = kv_crypto._associated_data(blob[: HEADER.size], "tenant-a", "cache-A", "kv/cache-A/f/0")
    with pytest.raises(InvalidTag):
        c.tenant_aead("tenant-b").decrypt(nonce, blob[HEADER.size :], ad)
    with pytest.raises(SealError) as info:
        c.open(blob, **{**NAMES, "tenant": "tenant-b"})
    assert info.value.reason == "auth_failed" and isinstance(info.value.__cause__, InvalidTag)


@pytest.mark.parametrize("field,other", [("cache_id", "cache-B"), ("key", "kv/cache-A/f/1"), ("tenant", "tenant-a2")])
def test_an_object_under_another_cache_id_key_or_tenant_fails(field: str, other: str) -> None:
    c = KVCipher([MASTER])
    blob = c.seal(KV, **NAMES)
    with pytest.raises(SealError, match="auth_failed"):
        c.open(blob, **{**NAMES, field: other})


def test_names_are_length_prefixed_in_the_associated_data() -> None:
    c = KVCipher([MASTER])
    blob = c.seal(KV, tenant="ab", cache_id="c", key="k")
    with pytest.raises(SealError):
        c.open(blob, tenant="a", cache_id="bc", key="k")


@pytest.mark.parametrize("where", ["key id", "nonce", "ciphertext", "tag"])
def test_a_flipped_byte_anywhere_fails(where: str) -> None:
    c = KVCipher([MASTER])
    blob = bytearray(c.seal(KV, **NAMES))
    at = {"key id": 9, "nonce": HEADER.size - 1, "ciphertext": HEADER.size + 100, "tag": len(blob) - 1}[where]
    blob[at] ^= 0x01
    with pytest.raises(SealError) as info:
        c.open(bytes(blob), **NAMES)
    # A changed key id names a master nobody holds; every other change fails the tag.
    assert info.value.reason == ("unknown_key" if where == "key id" else "auth_failed")


def test_not_a_sealed_object_is_malformed() -> None:
    c = KVCipher([MASTER])
    for blob in (b"", KV[:10], KV):  # too short; plaintext KV from a writer without encryption
        with pytest.raises(SealError, match="malformed"):
            c.open(blob, **NAMES)


def test_rotation_window_opens_old_objects_and_seals_with_the_new_key() -> None:
    new = os.urandom(32)
    old_cipher, rotated, new_only = KVCipher([MASTER]), KVCipher([new, MASTER]), KVCipher([new])
    old_blob = old_cipher.seal(KV, **NAMES)
    assert rotated.open(old_blob, **NAMES) == KV  # written before the rotation, still readable
    new_blob = rotated.seal(KV, **NAMES)
    assert new_only.open(new_blob, **NAMES) == KV
    with pytest.raises(SealError, match="unknown_key"):  # the old key dropped: its objects are unreadable
        new_only.open(old_blob, **NAMES)


def test_master_key_file_format(tmp_path: Path) -> None:
    new, old = os.urandom(32), os.urandom(32)
    keys = parse_master_keys(f"# rotated 2025-01\n{new.hex()}\n\n{old.hex()}  # until TTLs pass\n".encode(), "f")
    assert keys == [new, old]
    for bad in (b"", b"# only a comment\n", b"abcd\n", b"zz" * 32 + b"\n"):
        with pytest.raises(ConfigError, match="security.dir"):
            parse_master_keys(bad, "f")


def _cfg(security: dict) -> object:
    return SimpleNamespace(security=SecurityConfig(**security))  # what load_cipher reads of a config


def test_load_cipher_reads_security_dir_and_refuses_a_missing_key(tmp_path: Path) -> None:
    assert load_cipher(_cfg({"dir": str(tmp_path), "kv_encryption": {"enabled": False}})) is None
    with pytest.raises(ConfigError, match=r"security\.dir.*KV master key"):
        load_cipher(_cfg({"dir": str(tmp_path)}))
    ensure_symmetric_keys(tmp_path)
    assert (tmp_path / KV_MASTER_KEY).stat().st_mode & 0o077 == 0
    cipher = load_cipher(_cfg({"dir": str(tmp_path)}))
    assert cipher is not None and cipher.key_id == kv_crypto.key_id(bytes.fromhex((tmp_path / KV_MASTER_KEY).read_text()))
