"""The scale benchmark's 10^4-row run in the suite (jobs.scale: the real job with its
benchmark-only NullWorker on the session's Ray): the first half of the prompts, then a
--resume. Every prompt has exactly one ok row and the resume generated only the missing half.
Counts only: no wall time is asserted."""

from __future__ import annotations

import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.ledger import read_telemetry
from pipeline.storage import open_storage

N = 10_000


def test_ten_thousand_rows_then_a_resume_of_the_missing_half_exactly_once(tmp_path, ray_session):
    from jobs.scale import make_prompts, run_size

    got = run_size(N, tmp_path, str(tmp_path / "out"), actors=2, images=False, storage={}, full_run=False)
    assert got["rows"] == N  # run_size asserts each run's exit code 0 and its ok / skipped / job_ok counts
    tel = read_telemetry(open_storage(str(tmp_path / "out" / f"half_{N}")), columns=["prompt_id", "status", "run_id"])
    ids = tel["prompt_id"]
    want = make_prompts(tmp_path / "again.parquet", N)
    assert tel.num_rows == N and len(pc.unique(ids)) == N  # every prompt once, no repeat
    assert sorted(ids.to_pylist()) == sorted(pq.read_table(want, columns=["prompt_id"])["prompt_id"].to_pylist())
    assert pc.all(pc.equal(tel["status"], "ok")).as_py()
    by_run = {}
    for pid, run in zip(ids.to_pylist(), tel["run_id"].to_pylist()):
        by_run.setdefault(run, []).append(pid)
    halves = sorted((min(v), max(v), len(v)) for v in by_run.values())  # the first run, then the resume
    assert halves == [("s000000000", f"s{N // 2 - 1:09d}", N // 2), (f"s{N // 2:09d}", f"s{N - 1:09d}", N - N // 2)]
