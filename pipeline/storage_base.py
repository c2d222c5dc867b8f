"""The storage interface: object keys, locations and the `Storage` base class.

Kept apart from its backends (pipeline/storage.py: local folders and the factory;
pipeline/s3.py: S3) so both backends import this and nothing imports back: no circle.
Users import everything from pipeline.storage.
"""

from __future__ import annotations

import abc
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipeline.retry import call_with_retry

if TYPE_CHECKING:
    import pyarrow as pa

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
