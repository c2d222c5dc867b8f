"""jobs.study on a tiny grid: real pipeline runs of the random bundle on an in-process Ray,
a partly run grid resumed, one table row per cell with plausible numbers."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("matplotlib")

from jobs.study import cell_counts, parse_args, run_study  # noqa: E402
from jobs.study_table import CellResult, CellSpec, measure_cell, results_table  # noqa: E402


@pytest.fixture(scope="module")
def ray_local(ray_session):
    return ray_session  # the session's in-process Ray (tests/conftest.py)


def _args(tmp_path, methods: str):
    pq.write_table(pa.Table.from_pylist([{"prompt_id": f"p{i}", "prompt": f"a face {i}"} for i in range(3)]),
                   tmp_path / "prompts.parquet")
    return parse_args([
        "--output", str(tmp_path / "study"), "--input", str(tmp_path / "prompts.parquet"), "--bundles", "random:0",
        "--methods", methods, "--batches", "1,2", "--actors", "1", "--images", "3", "--warmup", "1",
        "--temperature", "0", "--config", str(_config(tmp_path)),
    ])


def _config(tmp_path):
    path = tmp_path / "base.json"
    path.write_text(json.dumps({"decode": {"tree": {"depth": 3, "top_k": 2, "budget": 6}, "max_tokens": 24}}))
    return path


def test_study_tiny_grid_resumes(tmp_path, ray_local):
    first = run_study(_args(tmp_path, "ar"))  # a partly run grid: only the ar cells
    assert first.num_rows == 2
    done = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "study" / "cells").glob("*/cell.json")}
    stray = tmp_path / "study" / "cells" / "random-0_float32_eagle2_b1_a1" / "telemetry" / "stale.parquet"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"left by a cell that was cut off")
    table = run_study(_args(tmp_path, "ar,eagle2"))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "study" / "cells").glob("*/cell.json")
            if p.name in done} == done  # finished cells were skipped
    assert not stray.exists()
    rows = table.to_pylist()
    assert sorted((r["method"], r["batch"], r["actors"]) for r in rows) == [
        ("ar", 1, 1), ("ar", 2, 1), ("eagle2", 1, 1), ("eagle2", 2, 1)]
    for r in rows:
        assert r["images"] == 3 and r["failed"] == 0 and r["device"] == "cpu"
        assert 0 < r["images_per_s"] < 1e4 and 0 < r["engine_images_per_s"] < 1e5
        assert math.isclose(r["images_per_s"], r["images_per_s_per_actor"])
        assert 0 < r["engine_ms_p50"] <= r["engine_ms_p90"]
        assert r["scaling_efficiency"] == pytest.approx(1.0)
        assert r["acceptance_length"] >= 1.0 and (r["method"] != "ar" or r["acceptance_length"] == 1.0)
        assert r["speedup_vs_ar"] > 0 and (r["method"] != "ar" or r["speedup_vs_ar"] == pytest.approx(1.0))
    out = tmp_path / "study"
    assert pq.read_table(out / "study.parquet").num_rows == 4
    md = (out / "study.md").read_text()
    assert md.count("\n| eagle2 |") == 2 and md.count("\n| ar |") == 2
    for name in ("study_batch.png", "study_scaling.png"):
        assert (out / name).stat().st_size > 5000
    assert (out / "prompts.parquet").exists()


def test_cell_counts_and_steady_window():
    spec = CellSpec("random", "float32", "adt", 4, 2)
    assert cell_counts(spec, 16, None) == (4, 24, 6)  # warm-up = batch per actor, measured split over actors
    import datetime as dt

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    rows = [{"prompt_id": f"{a}{i}", "status": "ok", "actor_id": a, "finished_at": t0 + dt.timedelta(seconds=s),
             "generation_time_ms": 500.0, "mean_acceptance_length": 2.0, "draft_acceptance_rate": 0.5}
            for a, times in (("x", [10, 11, 12, 13]), ("y", [20, 22, 24, 26])) for i, s in enumerate(times)]
    res = measure_cell(CellSpec("random", "float32", "adt", 1, 2), pa.Table.from_pylist(rows), warmup=1,
                       device="cpu", devices=1.0, wall_s=30.0)
    assert isinstance(res, CellResult)
    assert res.images == 6 and res.images_per_s == pytest.approx(1.0 + 0.5)  # 3 in 3 s, 3 in 6 s
    assert res.images_per_s_per_actor == pytest.approx(0.75) and res.engine_images_per_s == pytest.approx(4.0)
    t = results_table([res]).to_pylist()[0]
    assert t["speedup_vs_ar"] is None and t["scaling_efficiency"] == pytest.approx(1.0)
