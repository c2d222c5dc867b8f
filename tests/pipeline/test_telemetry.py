import datetime as dt
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from adt_core.results import GenerationResult, RoundTrace, StepStats
from pipeline.ledger import latest_per_prompt
from pipeline.summary import format_summary, summarize
from pipeline.telemetry import (
    SCHEMA,
    RowContext,
    add_baseline,
    calibrate_estimates,
    failed_row,
    ok_row,
    to_table,
    tokens_to_list,
)

CTX = RowContext(job_id="j", bundle="tiny", method="eagle2", config_hash="abc", actor_id="a1", node_id="n1", device="cpu")


def fake_result(total_ms=100.0, tokens=None):
    """A real engine result (adt_core.results types), so a renamed field fails here."""
    stats = StepStats(
        target_forwards=5, draft_forwards=20, draft_tokens=40, accepted_draft_tokens=10,
        accepted_lengths=[2, 3, 1, 4, 0], draft_ms=30.0, verify_ms=60.0, total_ms=total_ms,
        rounds=[RoundTrace(position=1, depth=5, width=10, nodes=8, accepted=2, draft_ms=1.0, verify_ms=2.0)],
        lossy=False, sampler="coupled", estimated_speedup=2.5,
    )
    grid = torch.arange(16).reshape(4, 4) if tokens is None else torch.as_tensor(tokens)
    return GenerationResult(prompt="x", seed=7, tokens=grid, image=np.zeros((16, 16, 3), np.uint8), stats=stats)


def test_ok_row_fills_schema():
    row = ok_row(CTX, "p1", 7, "images/p1.png", fake_result())
    t = to_table([row])
    assert t.schema.equals(SCHEMA)
    r = t.to_pylist()[0]
    assert r["status"] == "ok" and r["error"] is None and r["grid_h"] == 4 and r["tokens"] == list(range(16))
    assert r["num_spec_steps"] == 5 and r["num_target_forwards"] == 5 and r["num_draft_tokens"] == 40 and r["draft_acceptance_rate"] == 0.25
    assert r["rounds"][0]["nodes"] == 8 and r["estimated_speedup"] == 2.5 and r["speedup"] is None
    assert all(f.metadata[b"doc"] for f in SCHEMA)


def test_acceptance_vocabulary():
    # accepted_lengths: accepted DRAFTED tokens per round (bonus excluded); mean acceptance
    # length: tokens committed per round, 1 + accepted / rounds (bonus included)
    r = ok_row(CTX, "p1", 7, "images/p1.png", fake_result())
    assert r["accepted_lengths"] == [2, 3, 1, 4, 0] and r["num_accepted_draft_tokens"] == 10
    assert r["mean_acceptance_length"] == pytest.approx(1 + 10 / 5) and r["num_spec_steps"] == 5
    ar = fake_result()
    ar.stats = StepStats(target_forwards=16, total_ms=5.0, sampler="greedy")  # vanilla AR: no rounds, no drafts
    row = ok_row(CTX, "p2", 7, "images/p2.png", ar)
    assert (row["num_spec_steps"], row["mean_acceptance_length"], row["draft_acceptance_rate"]) == (0, 1.0, None)
    assert row["accepted_lengths"] == [] and row["rounds"] == []


def test_a_result_missing_a_field_fails_loudly():
    res = fake_result()  # the same stats with one field renamed: no silent 0
    fields = {k: getattr(res.stats, k) for k in (*vars(res.stats), "num_spec_steps", "mean_acceptance_length")}
    fields["drafted"] = fields.pop("draft_tokens")
    res.stats = SimpleNamespace(**fields)
    with pytest.raises(AttributeError, match="draft_tokens"):
        ok_row(CTX, "p1", 7, "images/p1.png", res)


def test_failed_row_and_baseline():
    f = failed_row(CTX, "p2", None, "invalid prompt: empty")
    row = ok_row(CTX, "p1", 7, "images/p1.png", fake_result(total_ms=50.0))
    add_baseline(row, fake_result(total_ms=150.0))
    assert row["speedup"] == pytest.approx(3.0) and row["baseline_tokens_match"] is True
    other = ok_row(CTX, "p3", 7, "images/p3.png", fake_result())
    add_baseline(other, fake_result(tokens=np.zeros((4, 4), int)))
    assert other["baseline_tokens_match"] is False
    t = to_table([f, row, other])
    assert t.column("status").to_pylist() == ["failed", "ok", "ok"]


def test_tokens_must_fit_int16():
    with pytest.raises(ValueError):
        tokens_to_list(np.array([[40000]]))
    with pytest.raises(ValueError):
        tokens_to_list(np.arange(4))


def test_summary_counts_and_text():
    rows = [ok_row(CTX, f"p{i}", i, f"images/p{i}.png", fake_result(total_ms=100.0)) for i in range(3)]
    add_baseline(rows[0], fake_result(total_ms=300.0))
    rows.append(failed_row(CTX, "bad", None, "invalid prompt: null"))
    s = summarize(to_table(rows), wall_time_s=2.0, skipped=5, total_input=9)
    assert (s["ok"], s["failed"], s["skipped"], s["processed"]) == (3, 1, 5, 4)
    assert s["images_per_second"] == 1.5
    assert s["speedup"] == {"count": 1, "mean": 3.0, "median": 3.0, "p10": 3.0, "p50": 3.0, "p90": 3.0}
    assert s["estimated_speedup"]["median"] == 2.5
    assert s["top_errors"] == [{"error": "invalid prompt: null", "count": 1}]
    text = format_summary(s, where={"images": "file:///x/images"})
    assert "ok 3" in text and "failed 1" in text and "3.00x" in text and "file:///x/images" in text
    assert len(text.splitlines()) < 25
    empty = summarize(SCHEMA.empty_table(), wall_time_s=0.0)
    assert empty["ok"] == 0 and empty["images_per_second"] is None
    format_summary(empty)


def test_latest_per_prompt_prefers_ok_then_latest():
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    rows = [
        failed_row(CTX, "a", 1, "first") | {"finished_at": t0},
        ok_row(CTX, "a", 1, "images/a.png", fake_result()) | {"finished_at": t0},
        failed_row(CTX, "a", 1, "later failure") | {"finished_at": t0 + dt.timedelta(hours=1)},
        failed_row(CTX, "b", 1, "old") | {"finished_at": t0},
        failed_row(CTX, "b", 1, "new") | {"finished_at": t0 + dt.timedelta(hours=1)},
    ]
    got = {r["prompt_id"]: r for r in latest_per_prompt(to_table(rows)).to_pylist()}
    assert got["a"]["status"] == "ok" and got["b"]["error"] == "new"
    assert isinstance(to_table(rows), pa.Table)


def test_every_column_is_documented():
    from pathlib import Path

    from pipeline.telemetry import COLUMN_NAMES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "pipeline.md").read_text()
    assert [c for c in COLUMN_NAMES if f"| `{c}` |" not in doc] == []


def test_rows_carry_caption_run_size_and_sampler():
    ctx = RowContext(job_id="j", bundle="tiny", method="adt", config_hash="abc", run_id="run-1")
    res = fake_result()
    res.image = np.zeros((48, 32, 3), np.uint8)  # H 48, W 32
    res.stats.sampler = "coupled"
    row = ok_row(ctx, "p1", 7, "images/p1.png", res, prompt="a red apple")
    assert (row["prompt"], row["run_id"], row["width"], row["height"], row["sampler"]) == ("a red apple", "run-1", 32, 48, "coupled")
    bad = failed_row(ctx, "p2", 1, "boom", prompt="x")
    assert bad["prompt"] == "x" and bad["run_id"] == "run-1" and bad["width"] is None
    to_table([row, bad])  # fits the schema


def test_summary_percentiles_and_steady_throughput():
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    rows = []
    for i in range(20):  # actor a: first row at t0+10 s (start-up), then one per second
        r = ok_row(CTX, f"a{i}", i, "k", fake_result(total_ms=100.0 * (i + 1)))
        rows.append(r | {"actor_id": "a", "finished_at": t0 + dt.timedelta(seconds=10 + i)})
    for i in range(10):  # actor b: up at t0+12 s
        r = ok_row(CTX, f"b{i}", i, "k", fake_result(total_ms=100.0))
        rows.append(r | {"actor_id": "b", "finished_at": t0 + dt.timedelta(seconds=12 + 2 * i)})
    s = summarize(to_table(rows), wall_time_s=60.0)  # one image in flight per actor
    g = s["generation_time_ms"]
    assert g["p10"] < g["p50"] < g["p90"] and g["count"] == 30
    assert s["mean_acceptance_length"]["p50"] is not None
    # after t0+12 s (both actors past their first image): a's rows at 13..29 (17) and b's at 14..30 (9)
    assert s["steady_images_per_second"] == pytest.approx(26 / 18)
    assert s["images_per_second"] == pytest.approx(30 / 60)
    assert "steady    1.44 images/s" in format_summary(s)


def test_estimates_are_calibrated_on_the_measured_rows_of_the_batch():
    rows = [{"status": "ok", "estimated_speedup": 2.0, "speedup": 1.0},
            {"status": "ok", "estimated_speedup": 4.0, "speedup": 3.0},
            {"status": "ok", "estimated_speedup": 3.0, "speedup": None}]
    calibrate_estimates(rows)  # ratios 0.5 and 0.75: median 0.625
    assert [r["estimated_speedup"] for r in rows] == [1.25, 2.5, 1.875]
    assert rows[2]["estimated_speedup_model"] == 3.0 and rows[2]["estimate_source"] == "calibrated on 2 measured rows"
    alone = [{"status": "ok", "estimated_speedup": 2.0, "speedup": None}]
    calibrate_estimates(alone)
    assert alone[0]["estimated_speedup"] == 2.0 and alone[0]["estimate_source"] == "model"


def test_baseline_mismatch_is_an_exactness_error_only_where_exactness_is_promised():
    res = fake_result()
    rows = []
    for i, (sampler, lossy) in enumerate([("coupled", False), ("rejection", False), ("coupled", True)]):
        r = ok_row(CTX, f"p{i}", i, f"images/p{i}.png", res)
        r["sampler"], r["lossy"] = sampler, lossy
        add_baseline(r, fake_result(tokens=np.zeros((4, 4), np.int64)))  # different tokens
        rows.append(r)
    s = summarize(to_table(rows), wall_time_s=1.0)
    assert s["baseline_tokens_mismatch"] == 3 and s["exactness_errors"] == 1
    text = format_summary(s)
    assert "ERROR     1 baseline rows" in text and "2 baseline rows differ from AR as expected" in text
