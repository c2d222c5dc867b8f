"""Object storage by URI: local paths / file:// and s3:// behind one small interface.

A `Storage` is rooted at a URI (the job's output root, say) and addresses objects by
relative keys such as ``images/p001.png``. Keys are checked so nothing escapes the root;
`safe_name` turns an arbitrary prompt id into one path segment, so an id like
``../../etc/passwd`` or ``a/b`` stays inside its prefix.

S3 goes through boto3 (object puts/gets) and pyarrow's `S3FileSystem` (Parquet via pyarrow
and Ray Data) built from the same endpoint, region and credentials. Both follow the standard
AWS environment: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION,
AWS_PROFILE, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, roles.
Credentials are never stored on these objects' reprs nor logged.

Every call is bounded: transient failures are retried for StorageSettings.retry_budget_s
(pipeline.retry), then, like any permanent failure (no such bucket, access denied, an
unwritable folder), end as `StorageUnavailable` naming the URI and the cause.

Modules: pipeline/storage_base.py holds the interface (keys, `Location`, `Storage`);
this module the local backend and `open_storage`; pipeline/s3.py the S3 backend. Both
backends import the interface, nothing imports back (no circle); import from here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import errno
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import pyarrow.fs as pafs

from pipeline.retry import StorageUnavailable
from pipeline.s3 import S3Options, S3Storage
from pipeline.storage_base import (DEFAULT_RETRY_BUDGET_S, Location, Storage, check_key, image_key, is_remote,
                                   parse_uri, safe_name)

if TYPE_CHECKING:
    from pipeline.config import StorageSettings


def current_umask() -> int:
    """The process umask, read without changing it (Linux), else by the set-and-restore dance."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class LocalStorage(Storage):
    """Files under a folder. Local errors are never transient: a full, read-only or
    forbidden folder fails at once (StorageUnavailable)."""

    def __init__(self, location: Location, retry_budget_s: float = DEFAULT_RETRY_BUDGET_S):
        self.location = location
        self.root = Path(location.path)
        self.retry_budget_s = retry_budget_s

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_beside(self, path: Path, data: bytes) -> str:
        """A complete temp file next to `path` with the mode the umask gives new files."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except FileNotFoundError as e:  # a folder that cannot be made (/proc/x): unwritable, not a missing key
            raise PermissionError(errno.EACCES, f"cannot create folder {path.parent}: {e.strerror}") from None
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-" + path.name[:40])
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; new files follow the umask
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    def put_bytes(self, key: str, data: bytes, content_type: Optional[str] = None) -> str:
        path = self._path(key)

        def put() -> None:
            # Write beside, then rename: a process killed mid-write leaves no partial object.
            tmp = self._write_beside(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

        self._call("write", key, put)
        return self.uri_for(key)

    def get_bytes(self, key: str) -> bytes:
        return self._call("read", key, self._path(key).read_bytes)

    def exists(self, key: str) -> bool:
        return self._call("stat", key, self._path(key).is_file)

    def list_keys(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root

        def walk() -> list[str]:
            if base.is_file():
                return [prefix]
            if not base.is_dir():
                return []
            keys = [p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file()]
            return sorted(k for k in keys if not Path(k).name.startswith((".tmp-", ".lock-")))

        return self._call("list", prefix, walk)

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self._path(key).unlink(missing_ok=True))

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)

        def create() -> bool:
            tmp = self._write_beside(path, data)
            try:
                os.link(tmp, path)  # atomic create-if-absent (like O_EXCL), with the whole content
                return True
            except FileExistsError:
                return False
            finally:
                Path(tmp).unlink(missing_ok=True)

        return self._call("create", key, create)

    @staticmethod
    def _token(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.get_bytes(key)
        return data, self._token(data)

    @contextlib.contextmanager
    def _locked(self, path: Path):
        lock = path.parent / f".lock-{path.name}"
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def replace(self, key: str, data: bytes, token: str) -> bool:
        path = self._path(key)

        def swap() -> bool:
            with self._locked(path):  # compare-and-swap: every replace of this key takes the lock
                try:
                    if self._token(path.read_bytes()) != token:
                        return False
                except FileNotFoundError:
                    return False
                os.replace(self._write_beside(path, data), path)
                return True

        return self._call("replace", key, swap)

    def arrow_fs(self) -> pafs.FileSystem:
        return pafs.LocalFileSystem()


def open_storage(uri: str, settings: "StorageSettings | None" = None) -> Storage:
    """The store rooted at `uri` (a path, file:// or s3:// URI)."""
    loc = parse_uri(uri)
    budget = settings.retry_budget_s if settings is not None else DEFAULT_RETRY_BUDGET_S
    if loc.scheme == "s3":
        return S3Storage(loc, S3Options.resolve(settings))
    return LocalStorage(loc, budget)


__all__ = ["Location", "LocalStorage", "Storage", "StorageUnavailable", "check_key", "image_key", "is_remote",
           "open_storage", "parse_uri", "safe_name"]
