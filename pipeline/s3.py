"""The s3:// backend of pipeline.storage: boto3 for objects, pyarrow's S3FileSystem for Parquet.

Both are built from the same endpoint, region and credentials (the standard AWS chain).
Retries are ours (pipeline.retry, a time budget): botocore and pyarrow each make one quick
attempt per call with `timeout_s` connect/read timeouts, so a dead endpoint fails a call
in seconds and the budget decides how long an outage is ridden out.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipeline.storage_base import DEFAULT_RETRY_BUDGET_S, Location, Storage, check_key

if TYPE_CHECKING:
    from pipeline.config import StorageSettings

# Credential providers whose keys expire: let pyarrow run its own refreshing chain for them.
_REFRESHING_METHODS = {"iam-role", "container-role", "assume-role", "assume-role-with-web-identity", "sso", "custom-process"}
DEFAULT_TIMEOUT_S = 20.0


def endpoint_has_userinfo(url: Optional[str]) -> bool:
    """True when an endpoint URL carries user:password@ (a secret that must not be used)."""
    return bool(url) and "@" in (urlparse(url).netloc or "")


@dataclass(frozen=True)
class S3Options:
    """Resolved endpoint/region/profile and call bounds (no secrets)."""

    endpoint_url: Optional[str]
    region: str
    profile: Optional[str]
    retry_budget_s: float = DEFAULT_RETRY_BUDGET_S
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def resolve(cls, settings: "StorageSettings | None" = None) -> "S3Options":
        env = os.environ
        endpoint = (settings.endpoint_url if settings else None) or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint_has_userinfo(endpoint):
            raise ValueError("the S3 endpoint URL (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3) must not contain user:password@; "
                             "give credentials through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile")
        region = (settings.region if settings else None) or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        profile = (settings.profile if settings else None) or env.get("AWS_PROFILE") or None
        budget = settings.retry_budget_s if settings is not None else DEFAULT_RETRY_BUDGET_S
        timeout = settings.timeout_s if settings is not None else DEFAULT_TIMEOUT_S
        return cls(endpoint or None, region, profile, budget, timeout)


def _boto3_session(opts: S3Options):
    import boto3

    return boto3.session.Session(profile_name=opts.profile, region_name=opts.region)


def s3_client(opts: S3Options):
    """A boto3 S3 client for `opts` (path-style addressing on custom endpoints)."""
    from botocore.config import Config

    cfg = Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=opts.timeout_s,
                 read_timeout=opts.timeout_s, s3={"addressing_style": "path"} if opts.endpoint_url else {})
    return _boto3_session(opts).client("s3", endpoint_url=opts.endpoint_url, region_name=opts.region, config=cfg)


def model_s3_client(settings: "StorageSettings | None" = None):
    """The boto3 client for model checkpoints named by a bundle manifest: the same endpoint,
    region, profile and per-request timeout as the job's output store (--storage.*), and
    botocore's standard retries sized to the same retry budget (a download is one long
    request that the budget cannot cut, so attempts = budget / timeout, at least 3)."""
    from botocore.config import Config

    opts = S3Options.resolve(settings)
    attempts = max(3, int(opts.retry_budget_s // max(opts.timeout_s, 1.0)))
    cfg = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=opts.timeout_s,
                 read_timeout=opts.timeout_s, s3={"addressing_style": "path"} if opts.endpoint_url else {})
    return _boto3_session(opts).client("s3", endpoint_url=opts.endpoint_url, region_name=opts.region, config=cfg)


def s3_arrow_fs(opts: S3Options) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem with the same endpoint, region and credentials as boto3."""
    kwargs: dict = {"region": opts.region, "connect_timeout": opts.timeout_s, "request_timeout": opts.timeout_s,
                    "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=2)}
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


def _is_missing(err: BaseException) -> bool:
    code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def _is_precondition(err: BaseException) -> bool:
    code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("412", "PreconditionFailed", "ConditionalRequestConflict", "409")


class S3Storage(Storage):
    def __init__(self, location: Location, opts: S3Options):
        self.location = location
        self.opts = opts
        self.retry_budget_s = opts.retry_budget_s
        self._client = None

    _client_lock = threading.Lock()  # writer threads share one client (boto3 clients are thread-safe, sessions not)

    @property
    def client(self):
        if self._client is None:  # lazily: the object must pickle to Ray workers without a client
            with self._client_lock:
                if self._client is None:
                    self._client = s3_client(self.opts)
        return self._client

    def __getstate__(self):
        return {"location": self.location, "opts": self.opts, "retry_budget_s": self.retry_budget_s, "_client": None}

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.location.path}/{key}" if self.location.path else key

    def put_bytes(self, key: str, data: bytes, content_type: Optional[str] = None) -> str:
        extra = {"ContentType": content_type} if content_type else {}
        k = self._key(key)
        self._call("write", key, lambda: self.client.put_object(Bucket=self.location.bucket, Key=k, Body=data, **extra))
        return self.uri_for(key)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        from botocore.exceptions import ClientError

        k = self._key(key)

        def get() -> tuple[bytes, str]:
            try:
                obj = self.client.get_object(Bucket=self.location.bucket, Key=k)
            except ClientError as e:
                if _is_missing(e):
                    raise FileNotFoundError(self.uri_for(key)) from None
                raise
            return obj["Body"].read(), obj.get("ETag", "")

        return self._call("read", key, get)

    def get_bytes(self, key: str) -> bytes:
        return self.get_versioned(key)[0]

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        k = self._key(key)

        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.location.bucket, Key=k)
                return True
            except ClientError as e:
                if _is_missing(e):
                    return False
                raise

        return self._call("stat", key, head)

    def list_keys(self, prefix: str = "") -> list[str]:
        root = self.location.path
        full = self._key(prefix) if prefix else (root + "/" if root else "")
        strip = len(root) + 1 if root else 0

        def walk() -> list[str]:
            keys: list[str] = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    k = obj["Key"][strip:]
                    # A prefix "images/p1" must not match "images/p10.png" unless asked for a folder.
                    if not prefix or k == prefix or k.startswith(prefix.rstrip("/") + "/"):
                        keys.append(k)
            return sorted(keys)

        return self._call("list", prefix, walk)

    def delete(self, key: str) -> None:
        k = self._key(key)
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.location.bucket, Key=k))

    def _conditional_put(self, key: str, data: bytes, **condition) -> bool:
        from botocore.exceptions import ClientError

        k = self._key(key)

        def put() -> bool:
            try:
                self.client.put_object(Bucket=self.location.bucket, Key=k, Body=data, **condition)
                return True
            except ClientError as e:
                if _is_precondition(e) or _is_missing(e):
                    return False
                raise

        return self._call("conditional write", key, put)

    def create(self, key: str, data: bytes) -> bool:
        return self._conditional_put(key, data, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, token: str) -> bool:
        return self._conditional_put(key, data, IfMatch=token)

    def arrow_fs(self) -> pafs.FileSystem:
        return s3_arrow_fs(self.opts)

    def __repr__(self) -> str:
        ep = f", endpoint={self.opts.endpoint_url!r}" if self.opts.endpoint_url else ""
        return f"S3Storage({self.uri!r}{ep})"

