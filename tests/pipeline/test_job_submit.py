"""`ray job submit` end to end against a real local Ray cluster that this test starts with
its own temp dir and ports, and stops by PID (never `ray stop`: other people's Ray too)."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline_helpers import simple_rows, write_prompts

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _our_processes(marker: str) -> list[int]:
    """PIDs whose command line mentions our cluster's unique temp dir."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.fixture
def ray_cluster(tmp_path):
    if not (BIN / "ray").exists():
        pytest.skip("ray CLI not installed in this environment")
    temp_dir = tempfile.mkdtemp(prefix="rtj", dir="/tmp")  # short: socket paths have a length limit
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=f"{BIN}:{os.environ.get('PATH', '')}",
               RAY_USAGE_STATS_ENABLED="0", AWS_EC2_METADATA_DISABLED="true",
               RAY_worker_niceness="0")  # normal priority on a shared machine (Ray's default is 15)
    env.pop("RAY_ADDRESS", None)
    dash = free_port()
    worker_lo = random.randrange(20000, 29000, 100)  # outside the default 10002-19999 others use
    ports = {
        "--port": free_port(), "--dashboard-port": dash, "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(), "--object-manager-port": free_port(),
        "--metrics-export-port": free_port(), "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port(),
        "--min-worker-port": worker_lo, "--max-worker-port": worker_lo + 99,
    }
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=4", "--num-gpus=0",
           f"--object-store-memory={256 * 1024**2}", "--disable-usage-stats"]
    cmd += [f"{k}={v}" for k, v in ports.items()]
    log = open(tmp_path / "ray_start.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:  # readiness: the job API answers (polling a condition, not a fixed sleep)
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}:\n{(tmp_path / 'ray_start.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{address}/api/version", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("ray cluster did not come up in 180 s")
            time.sleep(0.5)
        yield address, env
    finally:
        # Stop what we started, by PID: the `ray start --block` process group, then any
        # straggler that names our temp dir.
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in _our_processes(temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_end_to_end(tmp_path, ray_cluster):
    address, env = ray_cluster
    rows = simple_rows(5)
    src = write_prompts(tmp_path / "prompts.parquet", rows)
    out = tmp_path / "out"
    runtime_env = {"env_vars": {"AWS_EC2_METADATA_DISABLED": "true", "OMP_NUM_THREADS": "1"}}
    cmd = [
        str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
        "--runtime-env-json", json.dumps(runtime_env), "--",
        "python", "-m", "jobs.generate", "--job-id", "submitted", "--bundle", "random:0",
        "--input", str(src), "--output", str(out), "--num-actors", "2", "--batch-size", "2",
        "--decode.method", "ar", "--decode.temperature", "0", "--no-progress",
    ]
    deadline = time.monotonic() + 120
    while True:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
        logs = done.stdout + done.stderr
        # Right after start the head may not know its node's agent yet; Ray says to retry
        # and no job was created, so resubmitting is safe.
        if "No available agent to submit job" not in logs or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert done.returncode == 0, logs[-4000:]
    assert "succeeded" in logs and "connecting to Ray at" in logs and "ok 5   failed 0" in logs
    tel = pq.read_table(str(out / "telemetry")).to_pylist()
    assert Counter(r["prompt_id"] for r in tel) == Counter(r["prompt_id"] for r in rows)
    assert sorted(p.name for p in (out / "images").glob("*.png")) == [f"{r['prompt_id']}.png" for r in rows]
    assert (out / "images" / "metadata.parquet").is_file()  # imagefolder metadata beside the images
    assert json.loads((out / "summary.json").read_text())["ok"] == 5
