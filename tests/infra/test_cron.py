"""Scheduled generation: unfinished days rerun first, DAY override, incremental input, and
the script finds `ray` without cron's PATH."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.schedule import incremental_input, pending_days
from pipeline.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "cron" / "scheduled_generate.sh"


def make_day(root: Path, day: str, exit_code=None, ok_ids=()):
    d = root / f"daily-{day}"
    (d / "telemetry").mkdir(parents=True)
    (d / "job.json").write_text("{}")
    if exit_code is not None:
        (d / "summary.json").write_text(json.dumps({"exit_code": exit_code}))
    if ok_ids:
        pq.write_table(pa.table({"prompt_id": list(ok_ids), "status": ["ok"] * len(ok_ids),
                                 "finished_at": pa.array([dt.datetime(2024, 6, 1)] * len(ok_ids), pa.timestamp("ms", "UTC"))}),
                       d / "telemetry" / "run-x_c0_0.parquet")


def test_pending_days_rerun_unfinished_days_first(tmp_path):
    make_day(tmp_path, "20240601", exit_code=0)
    make_day(tmp_path, "20240602")  # started, killed before its summary
    make_day(tmp_path, "20240603", exit_code=4)  # storage down
    make_day(tmp_path, "20240604", exit_code=1)  # finished with failed rows: its own rerun retries them
    assert pending_days(open_storage(str(tmp_path)), "20240605") == ["20240602", "20240603", "20240605"]
    assert pending_days(open_storage(str(tmp_path)), "20240605", lookback=1) == ["20240605"]


def test_incremental_input_skips_prompts_done_on_earlier_days(tmp_path):
    src = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt_id": [f"p{i}" for i in range(5)], "prompt": ["x"] * 5}), src)
    make_day(tmp_path / "runs", "20240601", exit_code=0, ok_ids=["p0", "p1"])
    make_day(tmp_path / "runs", "20240602", exit_code=0, ok_ids=["p3"])
    uri = incremental_input(str(src), str(tmp_path / "runs"), "20240603")
    assert uri.endswith("inputs/daily-20240603.parquet")
    assert pq.read_table(tmp_path / "runs" / "inputs" / "daily-20240603.parquet")["prompt_id"].to_pylist() == ["p2", "p4"]


def _fake_bin(tmp_path: Path) -> Path:
    """A PYTHON that runs pipeline.schedule for real and logs job runs, and a `ray` beside it."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    (bin_dir / "python").write_text(
        f'#!/bin/bash\nif [[ "$2" == jobs.generate ]]; then echo "python $*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (bin_dir / "ray").write_text(f'#!/bin/bash\necho "ray $*" >> {log}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, **env) -> list[str]:
    bin_dir = _fake_bin(tmp_path)
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),  # cron's PATH: no ray on it
            "PYTHON": str(bin_dir / "python"), "REPO": str(ROOT), "OUTPUT_ROOT": str(tmp_path / "runs"),
            "INPUT": str(tmp_path / "prompts/{day}/")}
    done = subprocess.run(["bash", str(SCRIPT)], env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return (tmp_path / "calls.log").read_text().splitlines()


def test_script_resumes_the_unfinished_day_then_today_with_dated_inputs(tmp_path):
    today = dt.datetime.now(dt.timezone.utc).date()
    yesterday = (today - dt.timedelta(days=1)).strftime("%Y%m%d")
    make_day(tmp_path / "runs", yesterday)  # unfinished
    calls = _run(tmp_path)
    assert len(calls) == 2
    assert f"--job-id daily-{yesterday}" in calls[0] and f"prompts/{yesterday} " in calls[0] and "--resume" in calls[0]
    assert f"--job-id daily-{today:%Y%m%d}" in calls[1]


def test_script_day_override_and_cluster_submit_without_ray_on_path(tmp_path):
    calls = _run(tmp_path, DAY="20240601", RAY_JOB_ADDRESS="http://127.0.0.1:8265")
    assert len(calls) == 1 and calls[0].startswith("ray job submit --address http://127.0.0.1:8265")
    assert "--job-id daily-20240601" in calls[0] and f"--output {tmp_path}/runs/daily-20240601" in calls[0]
