"""What a model path in a manifest names, and how a fetched file is checked.

A path is local (a file or a directory), `s3://bucket/key` (models/s3_cache.py downloads it
once into a local cache) or `hf://<owner>/<repo>[@<revision>]/<path in the repo>` (a Hugging
Face Hub repository, read through huggingface_hub's own cache: bundles/hub.py). Whatever the
source, the manifest's sha256 (a hex string for a file, {relative file: hex} for a directory)
is checked on the local copy before anything is loaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Mapping

CHUNK = 8 << 20


class ManifestError(ValueError):
    """A manifest that cannot describe a bundle (bad field, missing file, unset variable)."""


class ChecksumError(ValueError):
    """A file whose sha256 differs from the one the manifest gives."""


# ---- URLs --------------------------------------------------------------------------------
def is_s3(path: str) -> bool:
    return str(path).startswith("s3://")


def is_hf(path: str) -> bool:
    return str(path).startswith("hf://")


def split_s3(url: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key)."""
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket:
        raise ManifestError(f"{url}: no bucket")
    return bucket, key


def split_hf(url: str) -> tuple[str, str, str]:
    """hf://owner/repo[@revision]/path -> (repo id, revision, path in the repo)."""
    parts = url[len("hf://"):].split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ManifestError(f"{url}: expected hf://<owner>/<repo>[@<revision>]/<path>")
    repo, _, revision = parts[1].partition("@")
    sub = parts[2] if len(parts) == 3 else ""
    if any(seg in (".", "..") for seg in sub.split("/")):
        raise ManifestError(f"{url}: '.' or '..' in the path")
    return f"{parts[0]}/{repo}", revision or "main", sub


# ---- checksums ---------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_sha(path: Path, expected: str | None, what: str) -> str | None:
    """The file's sha256 when `expected` is given (ChecksumError if they differ), else None."""
    if expected is None:
        return None
    got = sha256_file(path)
    if got.lower() != expected.lower():
        raise ChecksumError(f"{what}: sha256 {got} does not match the manifest's {expected.lower()}")
    return got


def check_sha_kind(path: str, is_dir: bool, sha256) -> None:
    """A directory takes {relative file: hex}, a file one hex string."""
    if is_dir and sha256 is not None and not isinstance(sha256, Mapping):
        raise ManifestError(f"{path}: is a directory; sha256 must map file names to hex strings")
    if not is_dir and isinstance(sha256, Mapping):
        raise ManifestError(f"{path}: is a single file; sha256 must be a hex string")


def verify_local(p: Path, sha256: str | Mapping[str, str] | None, what: str | None = None) -> None:
    """Check a local file or directory against the manifest's sha256 (nothing when None)."""
    what = what or str(p)
    check_sha_kind(what, p.is_dir(), sha256)
    if sha256 is None:
        return
    if isinstance(sha256, str):
        check_sha(p, sha256, what)
        return
    absent = sorted(rel for rel in sha256 if not (p / rel).is_file())
    if absent:
        raise ChecksumError(f"{what}: sha256 given for files not there: {absent}")
    for rel, h in sha256.items():
        check_sha(p / rel, h, f"{what.rstrip('/')}/{rel}")
