"""Progress as images finish: the worker yields rows before its call ends, the driver's sink
writes them as they come, and a real local-Ray job prints a progress line per tenth of its
images, the first within seconds of the pool starting; other libraries' progress is quiet."""

from __future__ import annotations

import io
import logging
import re
import time

import pyarrow as pa
import pytest

import pipeline.worker as worker_mod
from pipeline.config import build_config
from pipeline.driver import run_job
from pipeline.exit_codes import EXIT_OK
from pipeline.ledger import Ledger, read_telemetry
from pipeline.progress import Progress, quiet_progress_bars, quiet_ray_data
from pipeline.progress_sink import RowSink
from pipeline.retry import StorageUnavailable
from pipeline.storage import open_storage
from pipeline.telemetry import SCHEMA
from pipeline.worker import GeneratorWorker, pack, unpack
from fault_worker import paced_worker
from pipeline_helpers import simple_rows, write_prompts

PROGRESS = re.compile(r"\[generate\] progress (\d+)/(\d+) ")


class TimedLines(io.TextIOBase):
    """A non-terminal stream that keeps each line with the time it was written."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []
        self.buf = ""

    def write(self, s: str) -> int:
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.lines.append((time.monotonic(), line))
        return len(s)


# ---- the driver's progress ----------------------------------------------------------------


def test_a_line_per_tenth_a_heartbeat_while_nothing_finishes_and_the_last_row():
    now = [0.0]
    lines: list[str] = []
    p = Progress(40, lines.append, interval_s=5, clock=lambda: now[0])
    now[0] = 4.0
    p.tick()
    assert lines == []  # not yet an interval
    now[0] = 5.0
    p.tick()
    assert lines == ["progress 0/40 (0.0%), ok 0, waiting for the first images (5s since the pool started)"]
    for t in (14.0, 15.0, 34.0, 35.0):  # while waiting the gap doubles: 5 s, 10 s, 20 s
        now[0] = t
        p.tick()
    assert [x.split("(")[-1] for x in lines] == ["5s since the pool started)", "15s since the pool started)",
                                                  "35s since the pool started)"]
    lines[1:] = []
    now[0] = 36.0
    for _ in range(40):  # one row at a time, faster than the interval: one line per tenth
        p.add(1, 1)
    assert lines[-1].startswith("progress 40/40 (100.0%)")  # the first rows, then each tenth
    assert [int(re.match(r"progress (\d+)", x).group(1)) for x in lines[1:]] == [1, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]


def test_a_terminal_gets_one_bar_redrawn_in_place():
    now = [0.0]
    bar = io.StringIO()
    p = Progress(4, lambda s: pytest.fail(f"no plain lines on a terminal: {s}"), clock=lambda: now[0], bar=bar)
    now[0] = 1.0
    p.tick()
    p.add(2, 2)
    now[0] = 3.0
    p.add(2, 1)
    frames = bar.getvalue().split("\r")[1:]
    assert len(frames) == 3 and frames[-1].endswith("\n") and not frames[0].endswith("\n")
    assert "[" + "#" * 12 + "." * 12 + "] 2/4 50% ok 2" in frames[1]
    assert frames[-1].startswith("[" + "#" * 24 + "] 4/4 100% ok 3 done in 3s")  # no rate: the summary gives the run's


def test_foreign_lines_do_not_glue_onto_the_bar(monkeypatch):
    """Ray prints forwarded worker lines to sys.stdout / sys.stderr from its own thread: while a
    bar is drawn they start on a cleared line and the bar comes back under them."""
    term = io.StringIO()
    monkeypatch.setattr("sys.stdout", term)
    monkeypatch.setattr("sys.stderr", term)
    now = [0.0]
    p = Progress(4, lambda s: None, clock=lambda: now[0], bar=term)
    with p.foreign_output_below():
        p.add(1, 1)
        print("(MapWorker pid=7) worker ready")  # what Ray's log thread does
        now[0] = 2.0
        p.add(3, 3)
    text = term.getvalue()
    assert "ok 1 \x1b[K\r\x1b[K(MapWorker pid=7) worker ready\n\r[" in text  # the bar's line cleared, then redrawn below
    assert text.endswith("\n") and "4/4 100%" in text.rsplit("\r", 1)[1]
    assert __import__("sys").stdout is term  # restored


def test_other_libraries_progress_is_off_unless_asked(monkeypatch):
    from ray.data import DataContext

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # restored after the test
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    quiet_progress_bars(show=True)
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in __import__("os").environ
    quiet_progress_bars()
    from transformers.utils import logging as hf_logging

    assert __import__("os").environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and not hf_logging.is_progress_bar_enabled()
    ctx = DataContext.get_current().copy()
    quiet_ray_data(ctx)
    assert not ctx.enable_progress_bars
    assert logging.getLogger("ray.data._internal.progress").level == logging.ERROR
    assert logging.getLogger("ray.data._internal.execution.streaming_executor").level == logging.WARNING
    quiet_ray_data(ctx, show=True)
    assert ctx.enable_progress_bars and logging.getLogger("ray.data._internal.progress").level == logging.NOTSET


# ---- the sink: rows durable as they come, bursts in one part ------------------------------


def _rows(n: int, start: int = 0) -> pa.Table:
    return pa.Table.from_pylist([{"prompt_id": f"p{i}", "status": "ok"} for i in range(start, start + n)]).select(
        ["prompt_id", "status"])


def test_sink_writes_what_arrives_and_coalesces_a_burst(tmp_path):
    out = open_storage(str(tmp_path / "out"))
    ledger = Ledger(out, "run-x")
    said: list[str] = []
    sink = RowSink(ledger, Progress(30, said.append, interval_s=60), write_gap_s=0.3)
    sink.put(_rows(1))
    deadline = time.monotonic() + 5
    while ledger.rows_written < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ledger.rows_written == 1  # the first chunk is durable at once
    for i in range(1, 30):  # a burst within the write gap
        sink.put(_rows(1, i))
    sink.close()
    assert ledger.rows_written == 30 and ledger.seq <= 3  # 30 chunks, a few parts
    assert read_telemetry(out).num_rows == 30 and said[-1].startswith("progress 30/30 (100.0%)")


def test_sink_hands_a_storage_outage_to_the_main_thread(tmp_path, monkeypatch):
    out = open_storage(str(tmp_path / "out"))
    ledger = Ledger(out, "run-x")

    def down(*a, **k):
        raise StorageUnavailable(out.uri, "down")

    monkeypatch.setattr(out, "write_parquet", down)
    sink = RowSink(ledger, Progress(3, lambda s: None), write_gap_s=0.0)
    sink.put(_rows(1))
    with pytest.raises(StorageUnavailable):
        for i in range(1, 100):
            sink.put(_rows(1, i))
            time.sleep(0.02)
    sink.stop()  # raises nothing: the way out of an error


# ---- the worker: rows leave as images finish ----------------------------------------------


def _worker(tmp_path, **over) -> GeneratorWorker:
    data = {"job_id": "ptest", "bundle": "random:0", "output": str(tmp_path / "out"), "device": "cpu",
            "decode": {"method": "ar", "temperature": 0.0, "batch_size": 1}, **over}
    return GeneratorWorker(build_config(data).model_dump(mode="json"), num_threads=1)


def test_packed_chunks_round_trip():
    rows = [dict.fromkeys(SCHEMA.names) | {"prompt_id": f"p{i}", "status": "ok"} for i in range(3)]
    packed = pack(rows)
    assert packed.num_rows == 1  # one Arrow row: Ray Data cannot split or hold it back
    back = unpack(pa.concat_tables([packed, pack(rows[:1])]))
    assert back.schema.equals(SCHEMA) and back["prompt_id"].to_pylist() == ["p0", "p1", "p2", "p0"]


def test_worker_yields_each_image_before_its_call_ends(tmp_path, monkeypatch):
    """Images finishing 0.3 s apart leave one chunk each, while the call decodes on; the invalid
    row leaves at once, before any image."""
    monkeypatch.setattr(worker_mod, "YIELD_EVERY_S", 0.0)
    data = {"job_id": "ptest", "bundle": "random:0", "output": str(tmp_path / "out"), "device": "cpu",
            "decode": {"method": "ar", "temperature": 0.0, "batch_size": 1}}
    w = paced_worker(0.3)(build_config(data).model_dump(mode="json"), num_threads=1)
    batch = pa.Table.from_pylist(simple_rows(3) + [{"prompt_id": "bad", "prompt": "", "seed": 1}])
    chunks = [unpack(c) for c in w(batch)]
    assert [c["prompt_id"].to_pylist() for c in chunks] == [["bad"], ["p000"], ["p001"], ["p002"]]
    assert all(c["status"].to_pylist() == ["ok"] for c in chunks[1:])
    assert all((tmp_path / "out" / r).exists() for c in chunks[1:] for r in c["image_key"].to_pylist())


def test_rows_wait_for_the_measured_prompts_then_leave_calibrated(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_mod, "YIELD_EVERY_S", 0.0)
    w = _worker(tmp_path, baseline_fraction=0.5,
                decode={"method": "eagle2", "temperature": 0.0, "batch_size": 1,
                        "tree": {"depth": 2, "top_k": 2, "budget": 3}})
    rows = simple_rows(8)
    measured = {r["prompt_id"] for r in rows if worker_mod.in_baseline_sample(r["prompt_id"], 0.5)}
    assert 0 < len(measured) < 8
    chunks = [unpack(c) for c in w(pa.Table.from_pylist(rows))]
    assert len(chunks) > 1  # the unmeasured rows leave one by one after the measured ones
    assert measured <= set(chunks[0]["prompt_id"].to_pylist())  # measured prompts run first, their rows lead
    got = pa.concat_tables(chunks).to_pylist()
    assert all(r["estimate_source"] == f"calibrated on {len(measured)} measured rows" for r in got)
    assert {r["prompt_id"] for r in got if r["speedup"] is not None} == measured


# ---- a real local-Ray job -----------------------------------------------------------------


def test_job_prints_progress_per_tenth_of_images_as_they_finish(tmp_path, ray_session):
    n = 20
    src = write_prompts(tmp_path / "p.parquet", simple_rows(n))
    cfg = build_config({"job_id": "progress", "bundle": "random:0", "input": str(src), "output": str(tmp_path / "out"),
                        "num_actors": 1, "batch_size": n, "progress_interval_s": 1.0,
                        "decode": {"method": "ar", "temperature": 0.0, "batch_size": 1}})
    stream = TimedLines()
    res = run_job(cfg, stream=stream, worker=paced_worker(0.4))  # images finish one by one, 0.4 s+ apart
    assert res.exit_code == EXIT_OK and res.summary["ok"] == n
    start = next(t for t, line in stream.lines if "prompt(s) to generate" in line)
    progress = [(t, int(m.group(1))) for t, line in stream.lines if (m := PROGRESS.search(line))]
    assert progress[0][0] - start < 1.0 + 5.0  # the heartbeat: within seconds of the pool starting
    moving = [(t, done) for t, done in progress if done > 0]
    assert len(moving) >= 10, stream.lines  # at least one line per tenth of the images
    done = [d for _, d in moving]
    assert max(b - a for a, b in zip(done, done[1:])) <= n // 5, done  # no jump over two tenths at once
    t_last = moving[-1][0]
    assert any(d < n and t_last - t > 1.0 for t, d in moving), moving  # rows came back while the call ran
    text = "\n".join(line for _, line in stream.lines)
    assert "Total Progress" not in text and "report    python -m jobs.report" in text


def test_sink_takes_each_prompt_once_and_says_which_are_missing(tmp_path):
    """A retried batch's rows may repeat rows already delivered: the sink drops them (counted)."""
    import pyarrow as pa

    from pipeline.ledger import Ledger, read_telemetry
    from pipeline.progress import Progress
    from pipeline.progress_sink import RowSink
    from pipeline.storage import open_storage

    from pipeline.idset import IdSet, id_hashes

    store = open_storage(str(tmp_path / "out"))
    every = pa.array(["a", "b", "c", "d"])
    sink = RowSink(Ledger(store, "r"), Progress(4, lambda m: None, 3600), IdSet(id_hashes(every), 0))
    rows = lambda ids: pa.table({"prompt_id": ids, "status": ["ok"] * len(ids)})  # noqa: E731
    sink.put(rows(["a", "b"]))
    sink.put(rows(["b", "c", "c"]))
    sink.close()
    assert sink.duplicates == 2 and sink.missing().contains(every).tolist() == [False, False, False, True]
    assert sorted(read_telemetry(store, columns=["prompt_id"])["prompt_id"].to_pylist()) == ["a", "b", "c"]
