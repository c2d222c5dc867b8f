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
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlparse

import pyarrow.fs as pafs

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.config import StorageSettings

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME = 120
# Credential providers whose keys expire: let pyarrow run its own refreshing chain for them.
_REFRESHING_METHODS = {"iam-role", "container-role", "assume-role", "assume-role-with-web-identity", "sso", "custom-process"}


def safe_name(prompt_id: str) -> str:
    """One path segment for `prompt_id`: the id itself when it is already plain
    ([A-Za-z0-9._-], not starting with a dot, at most 120 chars), else a cleaned prefix plus
    a hash of the full id, so distinct ids keep distinct names and none can climb out."""
    cleaned = _UNSAFE.sub("_", prompt_id).lstrip(".")[:_MAX_NAME]
    if cleaned == prompt_id and cleaned:
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

    @property
    def uri(self) -> str:
        return self.location.uri

    def uri_for(self, key: str = "") -> str:
        return self.location.uri + ("/" + check_key(key) if key else "")

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
    def arrow_fs(self) -> pafs.FileSystem:
        """A pyarrow filesystem reaching this store (for Parquet and Ray Data)."""

    def arrow_path(self, key: str = "") -> str:
        """The path of `key` inside `arrow_fs()` (bucket/prefix/key for S3)."""
        loc = self.location
        base = loc.path if loc.scheme == "file" else "/".join(p for p in (loc.bucket, loc.path) if p)
        return base + ("/" + check_key(key) if key else "")

    def write_parquet(self, key: str, table: "pa.Table") -> str:
        """Write `table` as one Parquet object at `key`."""
        import pyarrow.parquet as pq

        fs, path = self.arrow_fs(), self.arrow_path(key)
        if self.location.scheme == "file":
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        pq.write_table(table, path, filesystem=fs)
        return self.uri_for(key)

    def read_parquet(self, key: str, columns: Optional[list[str]] = None) -> "pa.Table":
        """Read the Parquet object or folder of objects at `key`."""
        import pyarrow.parquet as pq

        return pq.read_table(self.arrow_path(key), filesystem=self.arrow_fs(), columns=columns)

    def put_text(self, key: str, text: str, content_type: str = "text/plain; charset=utf-8") -> str:
        return self.put_bytes(key, text.encode(), content_type)

    def get_text(self, key: str) -> str:
        return self.get_bytes(key).decode()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


class LocalStorage(Storage):
    def __init__(self, location: Location):
        self.location = location
        self.root = Path(location.path)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_bytes(self, key: str, data: bytes, content_type: Optional[str] = None) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write beside, then rename: a process killed mid-write leaves no partial object.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-" + path.name[:40])
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.uri_for(key)

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list_keys(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        keys = [p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file()]
        return sorted(k for k in keys if not Path(k).name.startswith(".tmp-"))

    def arrow_fs(self) -> pafs.FileSystem:
        return pafs.LocalFileSystem()


# ----------------------------------------------------------------------------------------
# S3


@dataclass(frozen=True)
class S3Options:
    """Resolved endpoint/region/profile (no secrets)."""

    endpoint_url: Optional[str]
    region: str
    profile: Optional[str]

    @classmethod
    def resolve(cls, settings: "StorageSettings | None" = None) -> "S3Options":
        env = os.environ
        endpoint = (settings.endpoint_url if settings else None) or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        region = (settings.region if settings else None) or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        profile = (settings.profile if settings else None) or env.get("AWS_PROFILE") or None
        return cls(endpoint or None, region, profile)


def _boto3_session(opts: S3Options):
    import boto3

    return boto3.session.Session(profile_name=opts.profile, region_name=opts.region)


def s3_client(opts: S3Options):
    """A boto3 S3 client for `opts` (path-style addressing on custom endpoints)."""
    from botocore.config import Config

    cfg = Config(retries={"max_attempts": 8, "mode": "standard"},
                 s3={"addressing_style": "path"} if opts.endpoint_url else {})
    return _boto3_session(opts).client("s3", endpoint_url=opts.endpoint_url, region_name=opts.region, config=cfg)


def s3_arrow_fs(opts: S3Options) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem with the same endpoint, region and credentials as boto3."""
    kwargs: dict = {"region": opts.region}
    if opts.endpoint_url:
        u = urlparse(opts.endpoint_url)
        kwargs["endpoint_override"] = u.netloc + u.path.rstrip("/")
        kwargs["scheme"] = u.scheme or "https"
    creds = _boto3_session(opts).get_credentials()
    if creds is not None and creds.method not in _REFRESHING_METHODS:
        frozen = creds.get_frozen_credentials()
        kwargs.update(access_key=frozen.access_key, secret_key=frozen.secret_key)
        if frozen.token:
            kwargs["session_token"] = frozen.token
    return pafs.S3FileSystem(**kwargs)


class S3Storage(Storage):
    def __init__(self, location: Location, opts: S3Options):
        self.location = location
        self.opts = opts
        self._client = None

    @property
    def client(self):
        if self._client is None:  # lazily: the object must pickle to Ray workers without a client
            self._client = s3_client(self.opts)
        return self._client

    def __getstate__(self):
        return {"location": self.location, "opts": self.opts, "_client": None}

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.location.path}/{key}" if self.location.path else key

    def put_bytes(self, key: str, data: bytes, content_type: Optional[str] = None) -> str:
        extra = {"ContentType": content_type} if content_type else {}
        self.client.put_object(Bucket=self.location.bucket, Key=self._key(key), Body=data, **extra)
        return self.uri_for(key)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.location.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise FileNotFoundError(self.uri_for(key)) from None

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.location.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def list_keys(self, prefix: str = "") -> list[str]:
        root = self.location.path
        full = self._key(prefix) if prefix else (root + "/" if root else "")
        strip = len(root) + 1 if root else 0
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                k = obj["Key"][strip:]
                # A prefix "images/p1" must not match "images/p10.png" unless asked for a folder.
                if not prefix or k == prefix or k.startswith(prefix.rstrip("/") + "/"):
                    keys.append(k)
        return sorted(keys)

    def arrow_fs(self) -> pafs.FileSystem:
        return s3_arrow_fs(self.opts)

    def __repr__(self) -> str:
        ep = f", endpoint={self.opts.endpoint_url!r}" if self.opts.endpoint_url else ""
        return f"S3Storage({self.uri!r}{ep})"


def open_storage(uri: str, settings: "StorageSettings | None" = None) -> Storage:
    """The store rooted at `uri` (a path, file:// or s3:// URI)."""
    loc = parse_uri(uri)
    if loc.scheme == "s3":
        return S3Storage(loc, S3Options.resolve(settings))
    return LocalStorage(loc)
