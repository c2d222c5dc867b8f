"""The run summary explains itself: a steady rate only over a window that means something,
the speedup line says what it compares with and whether it was measured, a run of mostly
plain AR steps says so and why, and the screen names jobs.report. docs/pipeline.md shows
the screen as it is printed."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pyarrow as pa

from pipeline.summary import STEADY_MIN_IMAGES, STEADY_MIN_S, format_summary, summarize
from pipeline.telemetry import SCHEMA

REPO = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def rows(n: int, spread_s: float, actors: int = 1, **cols) -> pa.Table:
    """n ok rows finishing evenly over `spread_s` seconds, round-robin over `actors`."""
    out = []
    for i in range(n):
        r = dict.fromkeys(SCHEMA.names)
        r.update(prompt_id=f"p{i}", status="ok", actor_id=f"a{i % actors}", generation_time_ms=250.0,
                 finished_at=T0 + dt.timedelta(seconds=spread_s * i / max(1, n - 1)), mean_acceptance_length=1.02,
                 draft_acceptance_rate=0.25, num_spec_steps=250, num_draft_tokens=25, estimated_speedup=0.87,
                 estimated_speedup_model=0.87, estimate_source="model", sampler="coupled", lossy=False)
        r.update(cols)
        out.append(r)
    return pa.Table.from_pylist(out, schema=SCHEMA)


def screen(table: pa.Table, wall: float = 52.0, in_flight: int = 64, **extra) -> tuple[dict, str]:
    s = summarize(table, wall_time_s=wall, total_input=table.num_rows, in_flight=in_flight)
    s.update({"method": "adt", "engine_batch": 64, "budget": "cost"} | extra)
    return s, format_summary(s, title="job t", report_hint="/data/out")


def test_one_wave_in_flight_shows_no_steady_rate():
    s, text = screen(rows(64, spread_s=2.3))
    assert s["steady_images_per_second"] is None
    assert "steady    not shown: no actor got past its first wave of images (up to 64 in flight each)" in text
    assert "images/s over the whole run (actor start-up included)" in text
    # 64 images x 250 ms of engine time on one actor: 4 images/s while decoding
    assert "decoding  4.00 images/s while the engine ran (64 images in 16.0 s of engine time)" in text


def test_a_short_window_after_the_first_wave_shows_no_steady_rate():
    s, text = screen(rows(80, spread_s=30.0))  # 16 images after the first wave of 64
    assert s["steady_images_per_second"] is None
    assert "not shown: after the first wave only 16 images finished, over 6.1 s" in text


def test_a_long_enough_window_gives_the_steady_rate():
    s, text = screen(rows(41, spread_s=40.0, actors=2), in_flight=1)
    assert STEADY_MIN_S <= 39 and 39 >= STEADY_MIN_IMAGES
    assert abs(s["steady_images_per_second"] - 39 / 39.0) < 1e-9  # after the second actor's first image
    assert "steady    1.00 images/s once every actor was past its first wave of images" in text
    assert "per actor, 2 actors" in text


def test_estimated_speedup_says_what_it_compares_with_and_why_it_is_low():
    _, text = screen(rows(64, spread_s=2.3))
    assert ("speedup   estimated 0.87x median vs batched AR at the same batch (64 in flight), from the rounds priced "
            "with this device's cost table (a model, not a measurement: --baseline-fraction above 0 measures it)") in text
    note = next(line for line in text.splitlines() if line.startswith("note"))
    assert "mostly plain AR steps (0.10 draft nodes per round)" in note and "cost budget" in note
    assert 'docs/adt_tree.md ("The cost budget")' in note
    assert text.splitlines()[-1].startswith("report    python -m jobs.report /data/out")


def test_measured_speedup_comes_first_and_the_estimate_says_it_was_scaled():
    t = rows(10, spread_s=2.0, num_draft_tokens=2000, estimate_source="calibrated on 2 measured rows")
    t = t.set_column(t.schema.get_field_index("speedup"), "speedup", pa.array([1.5, 1.7] + [None] * 8, pa.float64()))
    _, text = screen(t)
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("speedup"))
    assert lines[i].startswith("speedup   measured 1.60x median, 1.60x mean (n=2) vs batched AR at the same "
                               "occupancy (64 in flight)")
    assert lines[i + 1].startswith("          estimated 0.87x median") and "scaled by the measured rows" in lines[i + 1]
    assert not any(line.startswith("note") for line in lines)  # 8 nodes per round: the trees drafted


def test_ar_jobs_have_no_speedup_to_explain():
    _, text = screen(rows(4, spread_s=1.0), method="ar", budget=None)
    assert "speedup   - (method ar is the baseline itself)" in text and "note" not in text


def test_docs_show_the_screen_as_printed():
    """docs/pipeline.md's example screen has the labels, in order, that format_summary prints."""
    doc = (REPO / "docs" / "pipeline.md").read_text()
    block = re.search(r"```text\n(== job .*?)```", doc, re.S)
    assert block, "docs/pipeline.md shows no summary screen"
    labels = lambda text: [line[:10].strip() for line in text.splitlines() if line.strip()]  # noqa: E731
    _, text = screen(rows(64, spread_s=2.3))
    printed = labels(text.replace("== job t ==", "")) + ["images", "telemetry", "summary", "config"]
    shown = labels(block.group(1).split("\n", 1)[1])
    assert [x for x in shown if x] and set(shown) <= set(printed + [""]), (shown, printed)
    assert "steady    not shown" in block.group(1) or "steady " in block.group(1)
