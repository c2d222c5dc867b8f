"""Bounded retries for object-store calls, and the one error that means "storage is gone".

Every storage call of the pipeline runs through `call_with_retry`: transient failures
(connection refused or reset, timeouts, 5xx, throttling) are retried with capped exponential
backoff until `budget_s` seconds have passed since the first attempt (StorageSettings.
retry_budget_s, default 90 s: a blip of a minute is ridden out); then, or at once for a
permanent failure (no such bucket, access denied, a read-only or full disk), the call raises
`StorageUnavailable` naming the URI and the cause. The driver turns it into exit code 4.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from typing import Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = {
    "500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
    "RequestTimeTooSkewed", "Throttling", "ThrottlingException", "RequestLimitExceeded", "BandwidthLimitExceeded",
}
# Substrings of pyarrow's S3 errors (AWS SDK for C++) that mean "try again".
_TRANSIENT_TEXT = ("NETWORK_CONNECTION", "curlCode", "Couldn't connect", "Connection refused", "connection reset",
                   "SLOW_DOWN", "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE", "REQUEST_TIMEOUT", "Timeout was reached",
                   "timed out", "Connection reset")
_PERMANENT_ERRNO = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}
MAX_BACKOFF_S = 5.0


class StorageUnavailable(Exception):
    """The object store at `uri` cannot be used (down past the retry budget, or refused)."""

    def __init__(self, uri: str, cause: str):
        super().__init__(f"storage unavailable: {uri}: {cause}")
        self.uri = uri
        self.cause = cause

    def __reduce__(self):  # crosses Ray process boundaries intact
        return (type(self), (self.uri, self.cause))


def error_code(err: BaseException) -> str:
    """The S3 error code of a botocore ClientError ('' for anything else)."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", "") or response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


def is_transient(err: BaseException) -> bool:
    """Worth retrying: the same call may succeed once the network or the service is back."""
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - boto3 is a dependency
        bx = None
    if bx is not None:
        if isinstance(err, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                            bx.ConnectionClosedError, bx.ResponseStreamingError, bx.IncompleteReadError)):
            return True
        if isinstance(err, bx.HTTPClientError):  # urllib3 protocol / reset errors
            return True
        if isinstance(err, bx.ClientError):
            return error_code(err) in _TRANSIENT_CODES
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    if isinstance(err, OSError) and err.errno in _PERMANENT_ERRNO:
        return False
    text = str(err)
    return isinstance(err, OSError) and any(t in text for t in _TRANSIENT_TEXT)


def _is_storage_error(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return True
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(err, (BotoCoreError, ClientError))


def describe(err: BaseException) -> str:
    code = error_code(err)
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}{f' {code}' if code else ''}: {text}"[:300]


def call_with_retry(fn: Callable[[], T], *, uri: str, what: str, budget_s: float,
                    passthrough: tuple[type[BaseException], ...] = (FileNotFoundError,),
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """fn() with transient failures retried for up to `budget_s` seconds.

    Exceptions in `passthrough` (e.g. FileNotFoundError for a missing key) and errors that
    are not about storage (ValueError, ...) propagate as they are; every storage failure
    (OSError, botocore) ends as StorageUnavailable(uri, cause)."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except passthrough:
            raise
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - classified below
            if not _is_storage_error(e):
                raise  # a bug or a content problem (say, a corrupt file), not the store
            elapsed = time.monotonic() - start
            if not is_transient(e):
                raise StorageUnavailable(uri, f"{what} failed: {describe(e)}") from e
            backoff = min(MAX_BACKOFF_S, 0.1 * 2**attempt) * (0.5 + random.random() / 2)
            if elapsed + backoff > budget_s:
                raise StorageUnavailable(
                    uri, f"{what} failed: {describe(e)} (gave up after {elapsed:.1f} s and {attempt + 1} attempt(s); "
                         f"storage.retry_budget_s={budget_s:g})") from e
            if attempt == 0:
                log.warning("storage %s: %s failed (%s); retrying for up to %.0f s", uri, what, describe(e), budget_s)
            attempt += 1
            sleep(backoff)
