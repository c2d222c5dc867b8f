"""Images encoded and stored off the decode path: a bounded pool of writer threads.

The worker's decode loop hands each finished image to `ImageWriter.submit` and goes on with
the next round; a pool thread encodes the PNG and PUTs it (PIL's zlib and boto3's sockets
release the GIL). Between rounds the loop collects finished writes with `done()` (in
submission order, as (row, sample)), so a row only ever leaves after its image is durable, and
at most a round after. Back-pressure: at most `max_pending` writes are held (their arrays, then
their PNG bytes); `submit` waits for the oldest when the pool is full, so memory stays bounded
and a slow store slows decoding only once it cannot keep up. A store that is down fails each write's row (the write function decides),
and the driver's own ledger writes then end the job with exit 4, as before.

`wait_s` counts the seconds `submit` spent blocked on the pool (back-pressure): what the store
cost the decoder.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator

WRITE_THREADS = 8  # concurrent encodes + PUTs per actor: 8 PUTs of 200 ms each keep up with 40 images/s


class ImageWriter:
    def __init__(self, write: Callable[..., Any], max_pending: int, threads: int = WRITE_THREADS):
        self.write = write
        self.max_pending = max(1, max_pending)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="image-writer")
        self.pending: deque[Future] = deque()
        self.wait_s = 0.0

    def submit(self, *args: Any) -> list[Any]:
        """Queue one write. While `max_pending` writes are held, waits for the oldest
        (back-pressure) and returns the results collected to make room (submission order)."""
        out: list[Any] = []
        while len(self.pending) >= self.max_pending:
            t0 = time.perf_counter()
            wait([self.pending[0]])
            self.wait_s += time.perf_counter() - t0
            out += self.done()
        self.pending.append(self.pool.submit(self.write, *args))
        return out

    def done(self) -> Iterator[Any]:
        """The results of the finished writes at the head of the queue."""
        while self.pending and self.pending[0].done():
            yield self.pending.popleft().result()

    def drain(self) -> Iterator[Any]:
        """Every remaining result, waiting for each."""
        while self.pending:
            yield self.pending.popleft().result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
