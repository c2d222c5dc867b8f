"""The driver's compact state: prompt ids as hashes (pipeline.idset), the selection and the
row sink's seen-set built on them, and a run's rows as exact counters plus a bounded sample
(pipeline.tally). No Ray."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pytest

import pipeline.prompts as prompts
from pipeline.idset import IdSet, id_hashes, keep_hashes
from pipeline.prompts import PromptInputError, ids_in, open_prompts, select
from pipeline.summary import summarize
from pipeline.tally import RunTally
from pipeline.telemetry import SCHEMA
from pipeline.ledger import SUMMARY_COLUMNS
from pipeline_helpers import simple_rows, write_prompts

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def test_hashes_are_per_id_and_agree_across_chunking_and_slicing():
    ids = pa.array([f"s{i:05d}" for i in range(3000)] + ["", "é", "a\x00", "a"])
    h = id_hashes(ids)
    assert len(np.unique(h)) == len(ids)
    chunked = pa.chunked_array([ids.slice(0, 7), ids.slice(7, 2990), ids.slice(2997)])
    assert (id_hashes(chunked) == h).all() and (id_hashes(ids.slice(5, 9)) == h[5:14]).all()
    assert not (id_hashes(ids, salt=1) == h).all()


def test_the_seen_set_takes_each_member_once_and_names_the_missing():
    every = pa.array(["a", "b", "c", "d"])
    s = IdSet(id_hashes(every), 0)
    assert s.take_first(pa.array(["b", "b", "zz", "a"])).tolist() == [True, False, False, True]
    assert s.take_first(pa.array(["a", "c"])).tolist() == [False, True]
    assert s.seen_count == 3 and s.missing().contains(every).tolist() == [False, False, False, True]
    kept = keep_hashes(pa.table({"prompt_id": every}), s.missing().hashes, 0)
    assert kept["prompt_id"].to_pylist() == ["d"]
    assert keep_hashes(pa.table({"prompt_id": every}), None, 0)["prompt_id"].to_pylist() == ["a", "b", "c", "d"]  # every prompt


def test_selection_skips_done_ids_and_reads_ids_again_once_released(tmp_path):
    src = open_prompts(str(write_prompts(tmp_path / "p.parquet", simple_rows(6))))
    sel = select(src, 4, pa.array(["p001", "p005"]))
    assert (len(sel.todo), sel.skipped, sel.everything) == (3, 1, False)
    assert ids_in(src, sel.todo) == ["p000", "p002", "p003"]
    src.release()
    assert src.ids is None and ids_in(src, sel.todo) == ["p000", "p002", "p003"]
    assert select(open_prompts(str(tmp_path / "p.parquet")), None).everything


def test_a_hash_collision_takes_the_next_salt_and_a_repeat_is_refused(tmp_path, monkeypatch):
    real = prompts.id_hashes
    monkeypatch.setattr(prompts, "id_hashes", lambda ids, salt=0: real(ids, salt) * 0 if salt == 0 else real(ids, salt))
    src = open_prompts(str(write_prompts(tmp_path / "p.parquet", simple_rows(5))))
    assert src.salt == 1 and len(np.unique(src.hashes)) == 5  # salt 0 made every id collide
    rows = simple_rows(3) + simple_rows(1)
    with pytest.raises(PromptInputError, match=r"1 duplicate prompt_id value\(s\): 'p000' x2"):
        open_prompts(str(write_prompts(tmp_path / "d.parquet", rows)))


def _rows(n: int, actors: int = 2, start: int = 0) -> pa.Table:
    out = []
    for i in range(start, start + n):
        r = dict.fromkeys(SUMMARY_COLUMNS)
        failed = i % 10 == 0
        r.update(prompt_id=f"p{i}", status="failed" if failed else "ok", error="boom" if failed else None,
                 actor_id=f"a{i % actors}", generation_time_ms=100.0 + i % 7, finished_at=T0 + dt.timedelta(seconds=i),
                 sampler="greedy", lossy=False, baseline_tokens_match=(i % 3 != 0) if i % 5 == 1 else None,
                 num_spec_steps=10, num_draft_tokens=i % 4, estimate_source="calibrated on 3" if i % 2 else "model")
        out.append(r)
    return pa.Table.from_pylist(out, schema=pa.schema([SCHEMA.field(c) for c in SUMMARY_COLUMNS]))


def test_the_tally_is_summarize_until_it_samples_then_its_counts_stay_exact():
    table = _rows(1000)
    small = RunTally(sample_rows=5000)
    for start in range(0, 1000, 128):
        small.add(table.slice(start, 128))
    kw = dict(wall_time_s=10.0, skipped=2, total_input=1002, in_flight=4)
    empty = table.slice(0, 0)
    want = summarize(table, **kw)
    got = small.summary(empty, **kw)
    assert {k: got[k] for k in want} == want and got["sample_stride"] == 1

    sampled = RunTally(sample_rows=100)
    for start in range(0, 1000, 128):
        sampled.add(table.slice(start, 128))
    s = sampled.summary(empty, **kw)
    assert sampled.stride > 1 and s["sampled_rows"] <= 100 and sampled.rows == 1000
    for k in ("processed", "ok", "failed", "baseline_tokens_match", "baseline_tokens_mismatch", "exactness_errors",
              "estimate_calibrated_rows", "top_errors", "engine_actors", "draft_nodes_per_round",
              "images_per_second"):
        assert s[k] == want[k], k
    for k in ("engine_time_s", "decode_images_per_second"):
        assert abs(s[k] - want[k]) < 1e-6, k
