"""Images encoded and stored off the decode path: a bounded pool of writer threads.

The worker's decode thread hands each finished image to `ImageWriter.submit` and goes on with
the next round; a pool thread encodes the PNG and PUTs it (PIL's zlib and boto3's sockets
release the GIL). The worker's yielding thread collects finished writes with `done()` (in
submission order, as (row, sample)), woken by `ready` each time one finishes, so a row only
ever leaves after its image is durable and leaves as soon as it is. Back-pressure: at most
`max_pending` writes are held until collected (their arrays, then their PNG bytes); `submit`
waits while the pool is full, so memory stays bounded and a slow store slows decoding only once
it cannot keep up. A store that is down fails each write's row (the write function decides),
and the driver's own ledger writes then end the job with exit 4, as before.

`wait_s` counts the seconds `submit` spent blocked on the pool (back-pressure): what the store
cost the decoder. One thread submits and one collects (they may be the same thread).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

WRITE_THREADS = 8  # concurrent encodes + PUTs per actor: 8 PUTs of 200 ms each keep up with 40 images/s


class ImageWriter:
    def __init__(self, write: Callable[..., Any], max_pending: int, threads: int = WRITE_THREADS):
        self.write = write
        self.max_pending = max(1, max_pending)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="image-writer")
        self.pending: deque[Future] = deque()  # appended by the submitter, popped by the collector
        self.slots = threading.Semaphore(self.max_pending)  # a slot frees when its result is collected
        self.ready = threading.Event()  # set whenever a write finishes
        self.wait_s = 0.0

    def submit(self, *args: Any) -> None:
        """Queue one write; blocks while `max_pending` writes are held (back-pressure)."""
        if not self.slots.acquire(blocking=False):
            t0 = time.perf_counter()
            self.slots.acquire()
            self.wait_s += time.perf_counter() - t0
        future = self.pool.submit(self.write, *args)
        future.add_done_callback(lambda _: self.ready.set())
        self.pending.append(future)

    def done(self) -> Iterator[Any]:
        """The results of the finished writes at the head of the queue."""
        while self.pending and self.pending[0].done():
            yield self._collect()

    def drain(self) -> Iterator[Any]:
        """Every remaining result, waiting for each."""
        while self.pending:
            yield self._collect()

    def _collect(self) -> Any:
        future = self.pending.popleft()
        try:
            return future.result()
        finally:
            self.slots.release()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
