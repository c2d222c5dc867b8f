"""Rows from the actor pool to the ledger, and the progress they make.

The driver's main thread pulls chunks of rows from Ray Data and hands them to a `RowSink`;
the sink's thread writes them to the ledger (pipeline.ledger: durable parts) and counts them
in the run's `Progress`. Chunks that arrive while a write is under way, or within
WRITE_GAP_S of the last write, go into the next part together, so a fast pool on a slow
store writes a few larger parts instead of one part per image. The same thread ticks the
progress every TICK_S, so the heartbeat goes on while no image finishes (actors loading).

Each prompt's row is taken once: a chunk's rows for prompts that already have a row in this
run are dropped (`duplicates` counts them). They come from a batch that Ray retried after
its actor died mid-batch: the retry re-runs the whole batch, and Ray hands on only the
chunks past the ones the first attempt already delivered (it matches them by position, not
by content), so the retry's chunks can repeat rows as well as miss some. The driver runs
the missing ones again (pipeline.execute); `missing` says which did not come back. The
seen-set is the run's `IdSet` (pipeline.idset: a sorted uint64 hash and a bool a prompt,
~9 bytes, not a Python string), so the driver's memory does not grow by a string a row.

Shape of the hand-off: `put` blocks while QUEUE_CHUNKS chunks wait (backpressure on Ray
Data, as when the main thread wrote itself); a write that fails (StorageUnavailable) stops
the sink and is raised by the next `put` or by `close`.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.idset import IdSet
from pipeline.ledger import Ledger
from pipeline.progress import Progress

WRITE_GAP_S = 0.5  # at most one ledger part per this many seconds (a killed driver loses at most these rows)
TICK_S = 1.0
QUEUE_CHUNKS = 256
_STOP = object()


class RowSink:
    """A thread that writes arriving row tables to `ledger` and counts them in `progress`."""

    def __init__(self, ledger: Ledger, progress: Progress, ids: Optional[IdSet] = None,
                 write_gap_s: float = WRITE_GAP_S, tick_s: float = TICK_S):
        self.ledger, self.progress = ledger, progress
        self.ids = ids  # the run's prompts, each marked once its row came (None: no repeats dropped)
        self.strays = 0  # rows for prompts outside `ids` (none expected): kept, never dropped
        self.write_gap_s, self.tick_s = write_gap_s, tick_s
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_CHUNKS)
        self.error: Optional[BaseException] = None
        self.duplicates = 0  # rows dropped: their prompt already had one
        self.thread = threading.Thread(target=self._run, name="row-sink", daemon=True)
        self.thread.start()

    # ---- main thread ----------------------------------------------------------------------
    def put(self, table: pa.Table) -> None:
        """Hand one chunk of rows over (blocks while the queue is full); raises the sink's error.
        Rows of prompts that already have a row in this run are dropped (counted)."""
        if self.ids is not None and table.num_rows:
            member = self.ids.contains(table["prompt_id"])
            keep = self.ids.take_first(table["prompt_id"]) | ~member
            self.strays += int((~member).sum())
            if not keep.all():
                self.duplicates += int((~keep).sum())
                table = table.filter(pa.array(keep))
        if table.num_rows:
            self._put(table)

    def missing(self) -> IdSet:
        """The run's prompts that have no row yet."""
        return self.ids.missing()

    def close(self) -> None:
        """Write every chunk handed over and stop; raises the sink's error."""
        self.stop()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Write every chunk handed over and stop (raises nothing: for the way out of an error)."""
        if self.thread.is_alive():
            self._put(_STOP, check=False)
            self.thread.join()

    def _put(self, item: object, check: bool = True) -> None:
        while True:
            if self.error is None and not self.thread.is_alive():
                self.error = RuntimeError("the row sink's thread stopped")  # never wait on a dead consumer
            if self.error is not None:
                if check:
                    raise self.error
                return
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    # ---- the sink's thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e

    def _loop(self) -> None:
        pending: list[pa.Table] = []
        last_write = float("-inf")
        stop = False
        while not stop:
            now = time.monotonic()
            wait = max(0.0, last_write + self.write_gap_s - now) if pending else self.tick_s
            items = self._take(wait)
            stop = any(i is _STOP for i in items)
            pending += [i for i in items if i is not _STOP]
            if pending and (stop or time.monotonic() - last_write >= self.write_gap_s):
                if not self._write(pending):
                    return
                pending, last_write = [], time.monotonic()
            self.progress.tick()

    def _take(self, wait: float) -> list[object]:
        """Every chunk waiting now, after waiting up to `wait` seconds for the first."""
        items = []
        try:
            items.append(self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait())
            while True:
                items.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return items

    def _write(self, tables: list[pa.Table]) -> bool:
        table = pa.concat_tables(tables)
        try:
            self.ledger.add(table)  # durable before it counts as done
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
            return False
        self.progress.add(table.num_rows, pc.sum(pc.equal(table["status"], "ok")).as_py() or 0)
        return True
