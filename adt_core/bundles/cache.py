"""The local copies of a manifest's model files.

`LocalCache.fetch(path, sha256)` returns a local path for any source (bundles/sources.py):

- a local file or directory: as it is;
- s3://bucket/key: downloaded once into `root/s3/<bucket>/<key>` (root: the manifest's
  `cache_dir`, else $ADT_MODEL_CACHE, else ~/.cache/adt_core/models) and reused afterwards
  without network calls; a key ending in "/" or naming no object is a directory prefix;
- hf://owner/repo[@revision]/path: through huggingface_hub's own cache (bundles/hub.py).

The sha256 the manifest gives is checked on the local copy in every case; an S3 download that
does not match is deleted, never cached. boto3 follows the standard AWS environment
(AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION, credentials chain) unless the caller
passes its own client factory (the pipeline passes one built from the job's --storage.*
settings). Nothing about credentials is logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from adt_core.bundles.hub import fetch_hf
from adt_core.bundles.sources import (
    ChecksumError, ManifestError, check_sha, is_hf, is_s3, sha256_file, split_s3, verify_local,
)

log = logging.getLogger(__name__)

CACHE_ENV = "ADT_MODEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/adt_core/models")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so actors on one node download each file once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def s3_client():
    """A boto3 S3 client from the standard AWS environment (endpoint, region, credentials)."""
    try:
        import boto3
    except ImportError:
        raise ImportError("s3:// paths need boto3: pip install 'boto3>=1.35.69'") from None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return boto3.session.Session(region_name=region).client("s3", endpoint_url=endpoint)


class _Progress:
    """Byte progress: a tqdm bar on a terminal, else a log line every 10%."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done, self.next_log = name, max(total, 1), 0, 0.1
        self.bar = None
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name, disable=None,
                            leave=False)
            if self.bar.disable:
                self.bar = None
        except ImportError:
            pass

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done / self.total >= self.next_log:
            log.info("%s: %.0f%% of %.1f MB", self.name, 100 * self.done / self.total, self.total / 1e6)
            self.next_log += 0.1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LocalCache:
    """Local files as they are; s3:// objects downloaded once under `root/s3/<bucket>/<key>`;
    hf:// files from huggingface_hub's cache.

    A finished S3 download leaves `<file>.meta.json` (size, ETag, sha256); a file with one is
    reused without touching the network. Delete the file (or the cache) to force a refresh.
    """

    def __init__(self, root: str | os.PathLike | None = None, s3_client_factory: Callable[[], Any] | None = None) -> None:
        root = root or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
        self.root = Path(root).expanduser()
        self._client = None
        self._client_factory = s3_client_factory or s3_client

    @property
    def client(self):
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def fetch(self, path: str, sha256: str | Mapping[str, str] | None = None) -> Path:
        """A local path for `path` (a file or a directory), downloading S3 / Hub files if needed."""
        if is_hf(path):
            out = fetch_hf(path)
            verify_local(out, sha256, path)
            return out
        if not is_s3(path):
            p = Path(path)
            if not p.exists():
                raise FileNotFoundError(f"model file not found: {p}")
            verify_local(p, sha256)
            return p
        bucket, key = split_s3(path)
        if key and not key.endswith("/"):
            local = self._local(bucket, key)
            if self._cached(local, sha256 if isinstance(sha256, str) else None):
                return local
            head = self._head(bucket, key)
            if head is not None:
                if isinstance(sha256, Mapping):
                    raise ManifestError(f"{path}: is a single object; sha256 must be a hex string")
                return self._download(bucket, key, head, sha256)
        return self._fetch_dir(bucket, key.rstrip("/") + "/" if key else "", sha256)

    # -- s3 --
    def _local(self, bucket: str, key: str) -> Path:
        parts = [s for s in key.split("/") if s]
        if any(s in (".", "..") for s in parts):
            raise ManifestError(f"s3://{bucket}/{key}: '.' or '..' in the key")
        return self.root / "s3" / bucket / Path(*parts) if parts else self.root / "s3" / bucket

    @staticmethod
    def _meta(local: Path) -> Path:
        return local.with_name(local.name + ".meta.json")

    def _cached(self, local: Path, sha256: str | None) -> bool:
        meta = self._meta(local)
        if not (local.is_file() and meta.is_file()):
            return False
        try:
            info = json.loads(meta.read_text())
        except ValueError:
            return False
        if info.get("size") != local.stat().st_size:
            return False
        if sha256 is not None and str(info.get("sha256", "")).lower() != sha256.lower():
            return False
        log.info("using cached %s", local)
        return True

    def _head(self, bucket: str, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def _download(self, bucket: str, key: str, head: Mapping[str, Any], sha256: str | None) -> Path:
        local = self._local(bucket, key)
        url = f"s3://{bucket}/{key}"
        with _locked(local):
            if self._cached(local, sha256):  # another process finished it while we waited
                return local
            size = int(head.get("ContentLength", 0))
            tmp = local.with_name(local.name + ".partial")
            log.info("downloading %s (%.1f MB) to %s", url, size / 1e6, local)
            t0 = time.perf_counter()
            progress = _Progress(Path(key).name, size)
            try:
                self.client.download_file(bucket, key, str(tmp), Callback=progress)
            finally:
                progress.close()
            try:
                digest = check_sha(tmp, sha256, url) or sha256_file(tmp)
            except ChecksumError:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, local)
            meta = {"url": url, "size": local.stat().st_size, "etag": str(head.get("ETag", "")).strip('"'),
                    "sha256": digest}
            self._meta(local).write_text(json.dumps(meta, indent=1))
            dt = time.perf_counter() - t0
            log.info("downloaded %s in %.1f s (%.1f MB/s)", url, dt, size / 1e6 / max(dt, 1e-6))
            return local

    def _fetch_dir(self, bucket: str, prefix: str, sha256) -> Path:
        """Every object under `prefix` (a "directory"), each downloaded once."""
        if sha256 is not None and not isinstance(sha256, Mapping):
            raise ManifestError(f"s3://{bucket}/{prefix}: is a directory; sha256 must map file names to hex strings")
        sha256 = dict(sha256 or {})
        local_dir = self._local(bucket, prefix)
        done = self._meta(local_dir)
        if done.is_file() and local_dir.is_dir():
            files = json.loads(done.read_text()).get("files", [])
            if all(self._cached(local_dir / f, sha256.get(f)) for f in files) and set(sha256) <= set(files):
                return local_dir
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        if not keys:
            raise FileNotFoundError(f"s3://{bucket}/{prefix}: no such object or prefix")
        rels = [k[len(prefix):] for k in keys]
        absent = sorted(set(sha256) - set(rels))
        if absent:
            raise ManifestError(f"s3://{bucket}/{prefix}: sha256 given for files not there: {absent}")
        for k, rel in zip(keys, rels):
            local = self._local(bucket, k)
            if not self._cached(local, sha256.get(rel)):
                self._download(bucket, k, self.client.head_object(Bucket=bucket, Key=k), sha256.get(rel))
        local_dir.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps({"url": f"s3://{bucket}/{prefix}", "files": sorted(rels)}, indent=1))
        return local_dir
