"""One writer per output: a lease object at <output>/lease.json.

A job takes the lease before it writes anything and holds it until it ends:

    {"owner": "<job id>/<run id>", "host": ..., "pid": ..., "acquired_at": ..., "expires_at": ...}

- Taking it is a conditional create (`If-None-Match: *` on S3, an atomic hard link — the
  O_EXCL of a whole file — locally), so of two jobs started at once exactly one wins.
- A thread renews it every third of its lifetime (a conditional replace on the version
  read last), so a live job never loses it; a job that cannot renew (storage down past
  its retry budget, or the lease taken) is told through `on_lost` and stops.
- An expired lease (a crashed job) can be taken over with a conditional replace, and so can
  one whose process is gone on this same host (a killed driver, resumed at once).
- Released (deleted) when the job ends.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from pipeline.retry import StorageUnavailable
from pipeline.storage import Storage

log = logging.getLogger(__name__)

LEASE_KEY = "lease.json"


class LeaseHeld(Exception):
    """Another job holds the output's lease."""

    def __init__(self, message: str, holder: "LeaseInfo"):
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class LeaseInfo:
    owner: str
    host: str
    pid: int
    acquired_at: float
    expires_at: float

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes) -> Optional["LeaseInfo"]:
        try:
            d = json.loads(data)
            return cls(str(d["owner"]), str(d["host"]), int(d["pid"]), float(d["acquired_at"]), float(d["expires_at"]))
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: treated as stale

    def describe(self) -> str:
        left = self.expires_at - time.time()
        return f"{self.owner} on {self.host} (pid {self.pid}), expires in {left:.0f} s"


def _process_gone(info: LeaseInfo) -> bool:
    """The holder ran on this host and its process no longer exists."""
    if info.host != socket.gethostname():
        return False
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Lease:
    """The output's lease for one job run. Use `acquire`, then `release` (or `with`)."""

    def __init__(self, storage: Storage, owner: str, ttl_s: float, clock: Callable[[], float] = time.time):
        self.storage = storage
        self.owner = owner
        self.ttl_s = ttl_s
        self.clock = clock
        self._token: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None  # why renewal failed, if it did
        self.on_lost: Optional[Callable[[], None]] = None  # called (from the renewal thread) when it fails

    def _info(self, acquired_at: Optional[float] = None) -> LeaseInfo:
        now = self.clock()
        return LeaseInfo(self.owner, socket.gethostname(), os.getpid(), acquired_at or now, now + self.ttl_s)

    def try_acquire(self) -> Optional[LeaseInfo]:
        """Take the lease; returns None on success, else the current holder."""
        mine = self._info()
        if self.storage.create(LEASE_KEY, mine.to_bytes()):
            self._remember(mine)
            return None
        try:
            data, token = self.storage.get_versioned(LEASE_KEY)
        except FileNotFoundError:
            return self.try_acquire()  # released between our create and our read
        holder = LeaseInfo.parse(data)
        if holder is not None and holder.owner == self.owner:
            stale = True  # our own (a retry of this very run)
        else:
            stale = holder is None or holder.expires_at <= self.clock() or _process_gone(holder)
        if not stale:
            return holder
        if self.storage.replace(LEASE_KEY, mine.to_bytes(), token):
            log.warning("took over the output lease from %s", holder.describe() if holder else "an unreadable lease")
            self._remember(mine)
            return None
        return self.try_acquire()  # someone else changed it first: look again

    def _remember(self, mine: LeaseInfo) -> None:
        _, self._token = self.storage.get_versioned(LEASE_KEY)
        self._acquired_at = mine.acquired_at

    def acquire(self, wait_s: float = 0.0, poll_s: float = 2.0) -> None:
        """Take the lease, waiting up to `wait_s` for another holder; LeaseHeld if not."""
        deadline = time.monotonic() + wait_s
        while True:
            holder = self.try_acquire()
            if holder is None:
                break
            if time.monotonic() >= deadline:
                raise LeaseHeld(f"output {self.storage.uri} is in use by job {holder.describe()}; wait for it to finish, "
                                f"pass --lease-wait-s to wait, or choose another --output", holder)
            self._stop.wait(min(poll_s, max(0.0, deadline - time.monotonic())))
        self._thread = threading.Thread(target=self._renew_loop, name="output-lease", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        if self._token is None:
            return False
        if not self.storage.replace(LEASE_KEY, self._info(self._acquired_at).to_bytes(), self._token):
            self.lost = "the lease was changed by another job"
            return False
        _, self._token = self.storage.get_versioned(LEASE_KEY)
        return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.renew():
                    continue
            except StorageUnavailable as e:  # down past the retry budget
                self.lost = str(e)
            except Exception as e:  # noqa: BLE001 - anything else: try again next period
                log.warning("could not renew the output lease: %s", e)
                continue
            log.error("lost the output lease: %s", self.lost)
            if self.on_lost is not None and not self._stop.is_set():
                self.on_lost()
            return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._token is None:
            return
        try:
            data, _ = self.storage.get_versioned(LEASE_KEY)
            info = LeaseInfo.parse(data)
            if info is not None and info.owner == self.owner:
                self.storage.delete(LEASE_KEY)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - it expires by itself
            log.warning("could not release the output lease (it expires in %.0f s): %s", self.ttl_s, e)
        self._token = None
