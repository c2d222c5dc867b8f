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
unwritable folder), end as `StorageUnavailable` naming the URI and the cause. The S3 half
lives in pipeline/s3.py.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import hashlib
import io
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipeline.retry import StorageUnavailable, call_with_retry

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.config import StorageSettings

T = TypeVar("T")
DEFAULT_RETRY_BUDGET_S = 90.0

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME = 120


def safe_name(prompt_id: str) -> str:
    """One path segment for `prompt_id`: the id itself when it is already plain
    ([A-Za-z0-9._-], not starting with a dot, at most 120 chars), else a cleaned prefix plus
    a hash of the full id, so distinct ids keep distinct names and none can climb out.
    Ids with upper-case letters get the hash too: on a case-insensitive store (macOS,
    Windows, some S3 gateways) `A` and `a` would otherwise land on one file."""
    cleaned = _UNSAFE.sub("_", prompt_id).lstrip(".")[:_MAX_NAME]
    if cleaned == prompt_id and cleaned and cleaned == cleaned.lower():
        return cleaned
    digest = hashlib.sha256(prompt_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{cleaned or 'id'}-{digest}"


def image_key(prompt_id: str) -> str:
    """The image object's key under the output root (a pure function of the prompt id)."""
    return f"images/{safe_name(prompt_id)}.png"


def check_key(key: str) -> str:
    """A relative key with no empty, '.' or '..' segments; returned unchanged."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid storage key {key!r}: must be relative, without empty, '.' or '..' parts")
    return key


@dataclass(frozen=True)
class Location:
    scheme: str  # "file" | "s3"
    bucket: str  # "" for file
    path: str  # file: absolute path; s3: key prefix without leading/trailing slash

    @property
    def uri(self) -> str:
        if self.scheme == "file":
            return "file://" + self.path
        return f"s3://{self.bucket}/{self.path}".rstrip("/")


def parse_uri(uri: str) -> Location:
    """Split a path, file:// or s3:// URI. Local paths become absolute."""
    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a"):
        if not parsed.netloc:
            raise ValueError(f"s3 URI without a bucket: {uri!r}")
        return Location("s3", parsed.netloc, parsed.path.strip("/"))
    if parsed.scheme == "file":
        return Location("file", "", str(Path(parsed.netloc + parsed.path).resolve()))
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter = a Windows drive
        raise ValueError(f"unsupported URI scheme {parsed.scheme!r} in {uri!r} (use a path, file:// or s3://)")
    return Location("file", "", str(Path(uri).expanduser().resolve()))


def is_remote(uri: str) -> bool:
    return parse_uri(uri).scheme != "file"


# ----------------------------------------------------------------------------------------


class Storage(abc.ABC):
    """Objects under one root URI, addressed by relative keys."""

    location: Location
    retry_budget_s: float = DEFAULT_RETRY_BUDGET_S

    @property
    def uri(self) -> str:
        return self.location.uri

    def uri_for(self, key: str = "") -> str:
        return self.location.uri + ("/" + check_key(key) if key else "")

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """fn() under the retry budget; failures become StorageUnavailable naming the URI."""
        return call_with_retry(fn, uri=self.uri_for(key) if key else self.uri, what=what, budget_s=self.retry_budget_s)

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, content_type: Optional[str] = None) -> str:
        """Write (or overwrite) one object; returns its URI. Readers never see half an object."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read one object; FileNotFoundError when absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """Sorted keys (relative to the root) of all objects under `prefix`."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object (no error when it is already gone)."""

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if no object is there (atomically); False when one already was."""

    @abc.abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """(content, version token) of one object; FileNotFoundError when absent."""

    @abc.abstractmethod
    def replace(self, key: str, data: bytes, token: str) -> bool:
        """Overwrite `key` only while it still holds version `token`; False when it changed."""

    @abc.abstractmethod
    def arrow_fs(self) -> pafs.FileSystem:
        """A pyarrow filesystem reaching this store (for Parquet and Ray Data)."""

    def arrow_path(self, key: str = "") -> str:
        """The path of `key` inside `arrow_fs()` (bucket/prefix/key for S3)."""
        loc = self.location
        base = loc.path if loc.scheme == "file" else "/".join(p for p in (loc.bucket, loc.path) if p)
        return base + ("/" + check_key(key) if key else "")

    def write_parquet(self, key: str, table: "pa.Table") -> str:
        """Write `table` as one Parquet object at `key` (atomically, under the retry budget)."""
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(table, buf)
        return self.put_bytes(key, buf.getvalue(), "application/vnd.apache.parquet")

    def read_parquet(self, key: str, columns: Optional[list[str]] = None) -> "pa.Table":
        """Read the Parquet object or folder of objects at `key`."""
        import pyarrow.parquet as pq

        def read() -> "pa.Table":
            return pq.read_table(self.arrow_path(key), filesystem=self.arrow_fs(), columns=columns)

        return self._call("read Parquet", key, read)

    def put_text(self, key: str, text: str, content_type: str = "text/plain; charset=utf-8") -> str:
        return self.put_bytes(key, text.encode(), content_type)

    def get_text(self, key: str) -> str:
        return self.get_bytes(key).decode()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


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
        path.parent.mkdir(parents=True, exist_ok=True)
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
        from pipeline.s3 import S3Options, S3Storage

        return S3Storage(loc, S3Options.resolve(settings))
    return LocalStorage(loc, budget)


__all__ = ["Location", "LocalStorage", "Storage", "StorageUnavailable", "check_key", "image_key", "is_remote",
           "open_storage", "parse_uri", "safe_name"]
