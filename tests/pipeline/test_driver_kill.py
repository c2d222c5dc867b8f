"""Item 5: a driver SIGKILLed mid-run loses only the rows still in flight. The driver runs
as a real subprocess with its own local Ray (own temp dir); everything it started is
stopped by PID afterwards."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.config import build_config
from pipeline.driver import run_job
from pipeline.exit_codes import EXIT_OK
from pipeline.progress_sink import WRITE_GAP_S
from pipeline_helpers import simple_rows, write_prompts

REPO = Path(__file__).resolve().parents[2]


def _pids_mentioning(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes() or marker.encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return [p for p in pids if p != os.getpid()]


def durable_ok_ids(out: Path) -> set[str]:
    ids: set[str] = set()
    for f in (out / "telemetry").glob("*.parquet") if (out / "telemetry").is_dir() else []:
        try:
            t = pq.read_table(f, columns=["prompt_id", "status"]).to_pylist()
        except Exception:  # noqa: BLE001 - a file cut short by the kill
            continue
        ids |= {r["prompt_id"] for r in t if r["status"] == "ok"}
    return ids


def kill_driver_after(src: Path, out: Path, n_images: int, actors: int, batch: int, repo: Path = REPO,
                      total_limit_s: float = 240) -> tuple[int, int, float]:
    """Start the job CLI, SIGKILL it once `n_images` images are stored and the ledger holds a row;
    (stored, regenerated on resume, images stored per second before the kill)."""
    temp = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    env = dict(os.environ, RAY_TMPDIR=temp, RAY_worker_niceness="0", RAY_USAGE_STATS_ENABLED="0",
               AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=str(repo))
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "jobs.generate", "--bundle", "random:0", "--input", str(src), "--output", str(out),
           "--num-actors", str(actors), "--batch-size", str(batch), "--decode.method", "ar",
           "--decode.temperature", "0", "--no-progress", "--job-id", "killed"]
    log = open(out.parent / "driver.log", "wb")
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + total_limit_s
        images = out / "images"
        first = None
        while time.monotonic() < deadline and proc.poll() is None:
            n = sum(1 for p in images.iterdir() if p.suffix == ".png") if images.is_dir() else 0
            if n and first is None:
                first = time.monotonic()
            if n >= n_images and durable_ok_ids(out):
                break
            time.sleep(0.05)
        span = time.monotonic() - (first or time.monotonic())
        assert proc.poll() is None, (out.parent / "driver.log").read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _pids_mentioning(temp):  # Ray processes of the killed driver, by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
    stored = {p.stem for p in (out / "images").iterdir() if p.suffix == ".png"}
    return len(stored), len(stored - durable_ok_ids(out)), len(stored) / max(span, 1e-3)


def test_killed_driver_loses_at_most_the_batches_in_flight(tmp_path, ray_session):
    actors, batch = 1, 2
    rows = simple_rows(48)  # killed after 12 images: the driver has ~3.5 s of work left (~10 images/s on one core)
    src = write_prompts(tmp_path / "p.parquet", rows)
    out = tmp_path / "out"
    stored, regenerated, rate = kill_driver_after(src, out, n_images=12, actors=actors, batch=batch)
    # in flight at the kill: per actor, the batch streaming its images and the finished batches
    # whose rows the driver had not taken from Ray Data yet (up to three when the driver is
    # starved of CPU), plus the rows the sink holds between two ledger parts (at most one write
    # gap's worth, two when the sink's thread is starved); before the per-batch ledger a kill
    # lost every row of the run
    held = int(rate * 2 * WRITE_GAP_S) + 1
    assert stored >= 12 and regenerated <= 4 * actors * batch + held, (stored, regenerated, rate)
    assert regenerated < stored, (stored, regenerated)  # the ledger had rows when the driver died
    cfg = build_config({"job_id": "killed", "bundle": "random:0", "input": str(src), "output": str(out),
                        "num_actors": 1, "batch_size": 4, "decode": {"method": "ar", "temperature": 0.0},
                        "progress": False, "resume": True})
    res = run_job(cfg)  # the dead driver's lease is taken over at once (same host, process gone)
    assert res.exit_code == EXIT_OK and res.summary["job_ok"] == len(rows)
    assert res.summary["skipped"] == stored - regenerated  # every durable ok row was skipped, nothing else
