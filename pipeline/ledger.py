"""The telemetry ledger: what a job has done, durable as it goes.

The driver hands every batch of rows it receives from the workers to a `Ledger`, which
writes them as one Parquet *part* under <output>/telemetry/ right away (or once
`flush_rows` rows are waiting), so a driver killed mid-run loses only the batches still in
flight: resume redoes at most about one batch per actor. At the end of a run (and at the
start of the next, for a run that crashed) `compact` merges each run's parts into files of
up to `rows_per_file` rows and deletes the parts, so a million images do not leave a
million tiny files.

    telemetry/<run id>-part-<seq>.parquet        written during a run
    telemetry/<run id>_c<hash>_<n>.parquet       after compaction (hash of the merged parts)

Reading: `read_telemetry` (every file, unreadable ones skipped: their prompts are redone),
`done_ids` (ids whose row says ok) and `latest_per_prompt` (one row per id: an ok row,
else the latest). A storage outage while reading is not "no telemetry": it raises
StorageUnavailable.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.retry import StorageUnavailable
from pipeline.storage import Storage
from pipeline.tally import RunTally
from pipeline.telemetry import SAMPLE_COLUMNS, SCHEMA, STATUS_OK, TELEMETRY_DIR

log = logging.getLogger(__name__)

PART_MARK = "-part-"
# Columns the run summary needs; the ledger keeps only these in memory.
SUMMARY_COLUMNS = ["prompt_id", "status", "error", "finished_at", "actor_id", "speedup", "estimated_speedup",
                   "estimated_speedup_model", "estimate_source", "mean_acceptance_length", "draft_acceptance_rate",
                   "generation_time_ms", "baseline_tokens_match", "sampler", "lossy", "num_spec_steps",
                   "num_draft_tokens"]


def _telemetry_keys(output: Storage) -> list[str]:
    return [k for k in output.list_keys(TELEMETRY_DIR) if k.endswith(".parquet")]


def _run_of(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    return name.split(PART_MARK, 1)[0] if PART_MARK in name else name.split("_c", 1)[0]


def _read_columns(output: Storage, key: str, columns: Optional[list[str]]) -> pa.Table:
    """The file's `columns`; a file written before a column existed gives the ones it has."""
    try:
        return output.read_parquet(key, columns=columns)
    except StorageUnavailable:
        raise
    except Exception:  # noqa: BLE001 - a column this older file lacks (or damage: read again)
        if columns is None:
            raise
        table = output.read_parquet(key)
        return table.select([c for c in columns if c in table.column_names])


def read_telemetry(output: Storage, columns: Optional[list[str]] = None, name_prefix: str = "") -> pa.Table | None:
    """All readable telemetry files under <output>/telemetry (optionally only files whose
    name starts with `name_prefix`), concatenated; None when there are none. A file that
    cannot be parsed is skipped with a warning (its prompts are simply redone); a store
    that cannot be reached raises StorageUnavailable."""
    keys = [k for k in _telemetry_keys(output) if k.rsplit("/", 1)[-1].startswith(name_prefix)]
    tables = []
    for key in keys:
        try:
            tables.append(_read_columns(output, key, columns))
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file, not an outage
            log.warning("skipping unreadable telemetry file %s: %s", output.uri_for(key), e)
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="default")


def done_ids(output: Storage) -> set[str]:
    """Prompt ids whose telemetry says ok (their image was stored before the row)."""
    table = read_telemetry(output, columns=["prompt_id", "status"])
    if table is None:
        return set()
    ok = table.filter(pc.equal(table["status"], STATUS_OK))
    return set(ok["prompt_id"].to_pylist())


def latest_per_prompt(table: pa.Table) -> pa.Table:
    """One row per prompt id: an ok row if any, else the latest (by finished_at) failed one;
    ties go to the later row. Rows keep their input order. Pure Arrow (sort + group)."""
    n = table.num_rows
    if n == 0:
        return table
    ok = pc.cast(pc.fill_null(pc.equal(table["status"], STATUS_OK), False), pa.int8())
    ts = pc.fill_null(pc.cast(table["finished_at"], pa.int64()), 0)
    keyed = pa.table({"prompt_id": table["prompt_id"], "ok": ok, "ts": ts, "idx": pa.array(np.arange(n, dtype=np.int64))})
    keyed = keyed.sort_by([("ok", "ascending"), ("ts", "ascending"), ("idx", "ascending")])
    best = keyed.group_by("prompt_id", use_threads=False).aggregate([("idx", "last")])["idx_last"]
    return table.take(pa.array(np.sort(best.to_numpy())))


RESULT_COLUMNS = ["prompt_id", "status", "finished_at"]


@dataclass
class EarlierRuns:
    """The job's earlier runs, as counts: prompts with an ok row, prompts whose latest row
    failed, and which of this run's prompts are such failures (retried now)."""

    ok: int = 0
    failed: int = 0
    retried: Optional[np.ndarray] = None  # bool per todo member (IdSet order): failed earlier


def earlier_runs(output: Storage, resume: bool) -> tuple[EarlierRuns, Optional[tuple[pa.Array, pa.Array]]]:
    """(the earlier runs' counts, (ids done: an ok row, ids whose latest row failed)), from the
    job's telemetry (Arrow only: no Python string a row); nothing unless resuming."""
    table = read_telemetry(output, columns=RESULT_COLUMNS) if resume else None
    if table is None:
        return EarlierRuns(), None
    latest = latest_per_prompt(table)
    ok = pc.fill_null(pc.equal(latest["status"], STATUS_OK), False)
    done = latest["prompt_id"].filter(ok).combine_chunks()
    failed = latest["prompt_id"].filter(pc.invert(ok)).combine_chunks()
    return EarlierRuns(ok=len(done), failed=len(failed)), (done, failed)


def outputs_telemetry(output: Storage, fmt: str) -> Optional[pa.Table]:
    """The telemetry finish_outputs needs: for `files`, the wide columns only when some ok row
    names an image (a job without one writes no metadata: nothing wide is read)."""
    narrow = list(dict.fromkeys(RESULT_COLUMNS + ["image_key"]))
    if fmt != "files":
        return read_telemetry(output, columns=narrow)
    keys = read_telemetry(output, columns=["status", "image_key"])
    if keys is None or not pc.any(pc.and_(pc.equal(keys["status"], STATUS_OK), pc.is_valid(keys["image_key"]))).as_py():
        return None
    del keys
    return read_telemetry(output, columns=list(dict.fromkeys(narrow + SAMPLE_COLUMNS)))


# ----------------------------------------------------------------------------------------
# Writing


def release_arrow_memory() -> None:
    """Give the Arrow pool's freed pages back to the OS (mimalloc keeps them otherwise: the
    driver's RSS would stay at the peak of a selection or a compaction)."""
    pa.default_memory_pool().release_unused()


def _conform(table: pa.Table) -> pa.Table:
    """Rows in the telemetry schema (column order and types; missing columns as nulls)."""
    cols = [table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
            for f in SCHEMA]
    return pa.Table.from_arrays(cols, schema=SCHEMA)


class Ledger:
    """This run's telemetry: parts written as batches arrive; counted in a `RunTally` (exact
    counters and a bounded sample of the summary columns, not every row)."""

    def __init__(self, output: Storage, run_id: str, flush_rows: int = 1):
        self.output = output
        self.run_id = run_id
        self.flush_rows = flush_rows
        self._pending: list[pa.Table] = []
        self.tally = RunTally()
        self.seq = 0
        self.rows_written = 0
        self.first_row_at: Optional[float] = None  # perf_counter when the first row arrived

    def add(self, table: pa.Table) -> None:
        """Take one batch of rows; writes a part once `flush_rows` rows are waiting."""
        if table.num_rows == 0:
            return
        table = _conform(table)
        if self.first_row_at is None:
            self.first_row_at = time.perf_counter()
        self._pending.append(table)
        self.tally.add(table.select(SUMMARY_COLUMNS))
        if sum(t.num_rows for t in self._pending) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        """Write the waiting rows as one part (under the storage retry budget)."""
        if not self._pending:
            return
        table = pa.concat_tables(self._pending)
        self.output.write_parquet(f"{TELEMETRY_DIR}/{self.run_id}{PART_MARK}{self.seq:06d}.parquet", table)
        self.seq += 1
        self.rows_written += table.num_rows
        self._pending = []

    @property
    def rows_received(self) -> int:
        return self.tally.rows

    @property
    def actor_ids(self) -> list[str]:
        """Every actor id this run's rows name."""
        return sorted(a for a in self.tally.actors if a)

    def rows(self) -> pa.Table:
        """The rows this run received (summary columns): every one up to tally.SAMPLE_ROWS, a
        uniform sample past that (RunTally)."""
        sample = self.tally.sample()
        return SCHEMA.empty_table().select(SUMMARY_COLUMNS) if sample is None else sample

    def summary(self, **kw) -> dict:
        """summary.json's figures of this run's rows (RunTally.summary)."""
        return self.tally.summary(SCHEMA.empty_table().select(SUMMARY_COLUMNS), **kw)


def compact(output: Storage, rows_per_file: int = 100_000) -> int:
    """Merge every run's parts into files of up to `rows_per_file` rows, then delete the
    parts; returns the number of parts merged. Safe to repeat after a crash: the merged
    files are named by a hash of their parts, written before any part is deleted."""
    parts: dict[str, list[str]] = {}
    for key in _telemetry_keys(output):
        if PART_MARK in key.rsplit("/", 1)[-1]:
            parts.setdefault(_run_of(key), []).append(key)
    merged = 0
    for run, keys in sorted(parts.items()):
        keys.sort()
        tag = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:8]
        buffered: list[pa.Table] = []
        files = 0

        def write(table: pa.Table) -> None:
            nonlocal files
            output.write_parquet(f"{TELEMETRY_DIR}/{run}_c{tag}_{files:03d}.parquet", table)
            files += 1

        for key in keys:
            try:
                buffered.append(_conform(output.read_parquet(key)))
            except StorageUnavailable:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged part: its prompts are redone
                log.warning("dropping unreadable telemetry part %s: %s", output.uri_for(key), e)
                continue
            if sum(t.num_rows for t in buffered) >= rows_per_file:
                table = pa.concat_tables(buffered)
                full = table.num_rows // rows_per_file * rows_per_file
                for start in range(0, full, rows_per_file):
                    write(table.slice(start, rows_per_file))
                buffered = [table.slice(full)] if full < table.num_rows else []
        if sum(t.num_rows for t in buffered):
            write(pa.concat_tables(buffered))
        for key in keys:
            output.delete(key)
        merged += len(keys)
    return merged
