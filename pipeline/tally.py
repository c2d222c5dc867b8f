"""A run's rows as the driver keeps them: exact counters and a bounded sample, not every row.

The driver used to keep the summary columns of every row it received (~200 bytes a row: 2 GB
at 10^7 prompts) to compute summary.json at the end. A `RunTally` keeps instead

- exact counts and sums: rows, ok, failed, the failed rows' errors (their most common ones),
  the baseline comparisons (matches, mismatches, exactness errors), calibrated estimates,
  draft nodes and rounds, engine time, the actors seen (their restarts are asked of Ray);
- a uniform sample of the rows' summary columns, at most SAMPLE_ROWS rows: every row while
  the run has fewer, then every k-th row by arrival (k doubles each time the sample fills).

`summary()` is `pipeline.summary.summarize` over the sample with the exact figures put over
it: a run of up to SAMPLE_ROWS rows gets exactly the summary it always did; past that the
medians, percentiles and the steady rate come from the sample (the steady window's image
count scaled by k), and every count is exact.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.summary import summarize
from pipeline.telemetry import STATUS_FAILED, STATUS_OK

SAMPLE_ROWS = 100_000
MAX_ERRORS = 10_000  # distinct error texts counted; past that the rarest are forgotten


def _count(mask: pa.Array) -> int:
    return int(pc.sum(pc.cast(pc.fill_null(mask, False), pa.int64())).as_py() or 0)


def _sum(table: pa.Table, name: str, where: pa.Array) -> float:
    if name not in table.column_names:
        return 0.0
    return float(pc.sum(pc.fill_null(table[name].filter(where), 0)).as_py() or 0)


class RunTally:
    """Counters and a bounded sample of one run's rows (the ledger's SUMMARY_COLUMNS)."""

    def __init__(self, sample_rows: int = SAMPLE_ROWS):
        self.cap = sample_rows
        self.stride = 1
        self.rows = self.ok = self.failed = 0
        self.errors: Counter = Counter()
        self.actors: set[str] = set()
        self.sums: Counter = Counter()
        self._sample: list[pa.Table] = []
        self._sampled = 0

    def add(self, table: pa.Table) -> None:
        """Count one batch of rows (the ledger's summary columns)."""
        n = table.num_rows
        if n == 0:
            return
        status = table["status"]
        ok, failed = pc.equal(status, STATUS_OK), pc.equal(status, STATUS_FAILED)
        self.ok += _count(ok)
        self.failed += _count(failed)
        bad = table["error"].filter(pc.fill_null(failed, False))
        counts = pc.value_counts(pc.utf8_slice_codeunits(pc.fill_null(bad, ""), 0, 120))
        for err, k in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()):
            self.errors[err] += k
        if len(self.errors) > MAX_ERRORS:
            self.errors = Counter(dict(self.errors.most_common(MAX_ERRORS // 10)))
        self.actors.update(pc.unique(table["actor_id"]).to_pylist())
        self._sums(table, pc.fill_null(ok, False))
        idx = np.arange(self.rows, self.rows + n)
        self.rows += n
        self._keep(table.filter(pa.array(idx % self.stride == 0)), idx[idx % self.stride == 0])

    def _sums(self, t: pa.Table, ok: pa.Array) -> None:
        s = self.sums
        match = t["baseline_tokens_match"].filter(ok)
        s["baseline_tokens_match"] += _count(pc.equal(match, True))
        s["baseline_tokens_mismatch"] += _count(pc.equal(match, False))
        promised = pc.and_(pc.is_in(t["sampler"].filter(ok), value_set=pa.array(["greedy", "coupled"])),
                           pc.invert(pc.fill_null(t["lossy"].filter(ok), False)))
        s["exactness_errors"] += _count(pc.and_(pc.equal(match, False), promised))
        s["estimate_calibrated_rows"] += _count(pc.starts_with(t["estimate_source"].filter(ok), "calibrated"))
        s["spec_steps"] += _sum(t, "num_spec_steps", ok)
        s["draft_tokens"] += _sum(t, "num_draft_tokens", ok)
        gen = t["generation_time_ms"].filter(ok)
        s["generation_ms"] += float(pc.sum(gen).as_py() or 0)
        s["generation_rows"] += len(gen) - gen.null_count

    def _keep(self, rows: pa.Table, idx: np.ndarray) -> None:
        if rows.num_rows:
            self._sample.append(rows.append_column("_i", pa.array(idx, pa.int64())))
            self._sampled += rows.num_rows
        while self._sampled > self.cap:  # thin to every (2k)-th row of the run
            self.stride *= 2
            kept = pa.concat_tables(self._sample)
            kept = kept.filter(pc.equal(pc.bit_wise_and(kept["_i"], self.stride - 1), 0))
            self._sample, self._sampled = [kept], kept.num_rows

    def sample(self) -> Optional[pa.Table]:
        """The sampled rows (every row while the run has at most `cap`), None before any."""
        return pa.concat_tables(self._sample).drop_columns(["_i"]) if self._sample else None

    def summary(self, empty: pa.Table, *, wall_time_s: float, skipped: int = 0, total_input: Optional[int] = None,
                in_flight: int = 1) -> dict[str, Any]:
        """summarize() over the sample, with the exact counts over it once the run outgrew it."""
        table = self.sample()
        s = summarize(empty if table is None else table, wall_time_s=wall_time_s, skipped=skipped,
                      total_input=total_input, in_flight=in_flight)
        s["sampled_rows"], s["sample_stride"] = (0 if table is None else table.num_rows), self.stride
        if self.stride == 1:
            return s  # every row was kept: summarize's figures are exact
        k, sums = self.stride, self.sums
        actors = len(self.actors) or 1
        engine_s = sums["generation_ms"] / 1000.0 / actors
        s.update(processed=self.ok + self.failed, ok=self.ok, failed=self.failed,
                 images_per_second=self.ok / wall_time_s if wall_time_s > 0 else None,
                 decode_images_per_second=sums["generation_rows"] / engine_s if engine_s > 0 else None,
                 engine_time_s=engine_s, engine_actors=actors,
                 steady_images_per_second=(s["steady_images_per_second"] * k  # the sample has 1/k of the images
                                           if s["steady_images_per_second"] is not None else None),
                 draft_nodes_per_round=(sums["draft_tokens"] / sums["spec_steps"]) if sums["spec_steps"] else None,
                 estimate_calibrated_rows=int(sums["estimate_calibrated_rows"]),
                 baseline_tokens_match=int(sums["baseline_tokens_match"]),
                 baseline_tokens_mismatch=int(sums["baseline_tokens_mismatch"]),
                 exactness_errors=int(sums["exactness_errors"]),
                 top_errors=[{"error": e, "count": n} for e, n in self.errors.most_common(5)])
        return s
