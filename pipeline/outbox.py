"""One worker call's rows on their way out of the actor, and the chunk format they travel in.

`Outbox` holds a call's finished rows until they may leave (estimates calibrated on the call's
measured rows; with shard outputs, images in a written shard) and releases them at most every
`every_s` seconds. `pack` puts a chunk of rows into one Arrow row (column `rows`: a list of
telemetry structs) so Ray Data hands it on at once instead of merging it into a block of its
own size target; `unpack` is its inverse.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator, Optional

import pyarrow as pa

from pipeline.shards import Sample
from pipeline.telemetry import SCHEMA, calibrate_estimates, empty_table, to_table

if TYPE_CHECKING:
    from pipeline.worker import GeneratorWorker

PACKED_COLUMN = "rows"
PACKED_TYPE = pa.list_(pa.struct(list(SCHEMA)))


def pack(rows: list[dict]) -> pa.Table:
    """Telemetry rows -> one Arrow row holding them all (column `rows`: list<telemetry struct>)."""
    structs = to_table(rows).to_struct_array().combine_chunks()
    return pa.table({PACKED_COLUMN: pa.ListArray.from_arrays(pa.array([0, len(rows)], pa.int32()), structs)})


def unpack(table: pa.Table) -> pa.Table:
    """The telemetry rows of packed chunks (the inverse of `pack`, for any number of chunks)."""
    if table.num_rows == 0:
        return empty_table()
    structs = table[PACKED_COLUMN].combine_chunks().flatten()
    return pa.Table.from_struct_array(structs).cast(SCHEMA)



class Outbox:
    """One call's rows on their way out. A row leaves once (1) its speedup estimate is final:
    rows wait until every measured prompt of the call has finished, then all estimates are
    scaled by the measured / modelled ratio of those rows (telemetry.calibrate_estimates), and
    (2) with shard outputs, its image is in a written shard (every `shard_size` images, else at
    the end of the call)."""

    def __init__(self, worker: "GeneratorWorker", sharded: bool, every_s: float):
        self.worker, self.sharded, self.every_s = worker, sharded, every_s
        self.waiting: list[dict] = []  # rows whose estimate is not final yet
        self.ready: list[dict] = []  # rows that may leave
        self.samples: list[Sample] = []  # images of final rows not in a shard yet
        self.measured: set[str] = set()  # measured prompts not finished yet
        self.anchors: Optional[list[dict]] = None  # (speedup, modelled estimate) of the measured rows
        self.last = time.monotonic()

    def expect_measured(self, prompt_ids: set[str]) -> None:
        self.measured = set(prompt_ids)

    def add(self, row: dict, sample: Optional[Sample] = None) -> None:
        self.measured.discard(row["prompt_id"])
        self.waiting.append(row)
        if sample is not None:
            self.samples.append(sample)

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.every_s

    def _finalise(self, final: bool) -> None:
        """Calibrate the waiting rows' estimates once the measured rows are in; they may leave."""
        ok = [r for r in self.waiting if r["status"] == "ok"]
        if self.anchors is None:
            if self.measured and not final:
                return
            self.anchors = [{"speedup": r["speedup"], "estimated_speedup": r["estimated_speedup"]}
                            for r in ok if r.get("speedup") and r.get("estimated_speedup")]
            calibrate_estimates(ok)  # the measured rows are among these
        else:
            calibrate_estimates([dict(a) for a in self.anchors] + ok)  # the copies carry the measured ratio
        in_shard = {id(s.row) for s in self.samples}
        self.ready += [r for r in self.waiting if id(r) not in in_shard]
        self.waiting = []

    def release(self, final: bool = False) -> Iterator[pa.Table]:
        self._finalise(final)
        size = self.worker.cfg.shard_size
        if self.sharded and self.anchors is not None and self.samples and (final or (size and len(self.samples) >= size)):
            cut = len(self.samples) if final else len(self.samples) // size * size
            self.ready += self.worker.write_shards(self.samples[:cut])
            self.samples = self.samples[cut:]
        if self.ready:
            self.worker.metrics.record(self.ready)
            yield pack(self.ready)
            self.ready = []
        self.last = time.monotonic()
