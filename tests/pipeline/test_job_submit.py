"""`ray job submit` end to end against a real multi-node Ray cluster that this test starts
with `ray start` (a head with 1 CPU and no GPU, two worker nodes of 2 CPUs and 1 logical GPU
each), with its own temp dir and ports, and stops by PID (never `ray stop`: other people's Ray
too). The job's actors reserve the logical GPUs and compute on CPU (ADT_ENGINE_ON_CPU=1, the
documented test override), so they can only run on the worker nodes."""

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

from pipeline.execute import CPU_ENGINE_ENV
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
           "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=1", "--num-gpus=0",
           f"--object-store-memory={256 * 1024**2}", "--disable-usage-stats"]
    cmd += [f"{k}={v}" for k, v in ports.items()]
    log = open(tmp_path / "ray_start.log", "wb")
    procs = [subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)]
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait(procs, tmp_path, lambda: _get(f"{address}/api/version") is not None, "the head's job API")
        for i in range(GPU_NODES):  # one at a time: Ray gives a starting node 30 s to register
            for attempt in range(2):  # on a loaded machine that can pass: try once more
                node_log = tmp_path / f"ray_node{i}_{attempt}.log"
                with open(node_log, "wb") as out:
                    procs.append(subprocess.Popen(_worker_node_cmd(ports["--port"], temp_dir), env=env, stdout=out,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
                if _joined(procs[-1], address, 2 + i) or "timed out during startup" not in node_log.read_text():
                    break
                procs.pop()
            _wait(procs, tmp_path, lambda: _alive_nodes(address) >= 2 + i, f"worker node {i + 1}")
        yield address, env
    finally:
        # Stop what we started, by PID: each `ray start --block` process group (workers first),
        # then any straggler that names our temp dir.
        for proc in reversed(procs):
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


GPU_NODES = 2


def _worker_node_cmd(gcs_port: int, temp_dir: str) -> list[str]:
    """`ray start` of a worker node joining the head: 2 CPUs, 1 logical GPU, its own ports."""
    lo = random.randrange(30000, 39000, 100)
    ports = {"--node-manager-port": free_port(), "--object-manager-port": free_port(),
             "--metrics-export-port": free_port(), "--dashboard-agent-listen-port": free_port(),
             "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port(),
             "--min-worker-port": lo, "--max-worker-port": lo + 99}
    return [str(BIN / "ray"), "start", f"--address=127.0.0.1:{gcs_port}", "--block", f"--temp-dir={temp_dir}",
            "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=1", f"--object-store-memory={80 * 1024**2}",
            "--disable-usage-stats"] + [f"{k}={v}" for k, v in ports.items()]


def _get(url: str):
    """The JSON (or text) a GET answers, None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            body = r.read().decode()
    except OSError:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body


def _state(address: str, kind: str) -> list[dict]:
    """The head's state API list of `kind` (nodes, actors); [] while it does not answer."""
    got = _get(f"{address}/api/v0/{kind}?limit=1000&detail=1")
    try:
        return got["data"]["result"]["result"]
    except (TypeError, KeyError):
        return []


def _alive_nodes(address: str) -> int:
    return sum(n.get("state") == "ALIVE" for n in _state(address, "nodes"))


def _joined(proc, address: str, nodes: int, limit_s: float = 180) -> bool:
    """Until the cluster has `nodes` alive nodes (True) or `proc` exited (False)."""
    deadline = time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        if _alive_nodes(address) >= nodes:
            return True
        time.sleep(0.5)
    return False


def _wait(procs, tmp_path, ready, what: str, limit_s: float = 180) -> None:
    """Until `ready()` (polling a condition, not a fixed sleep); fails if a `ray start` exited."""
    deadline = time.monotonic() + limit_s
    while not ready():
        for proc in procs:
            if proc.poll() is not None:
                logs = "".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("ray_*.log")))
                pytest.fail(f"ray start exited with {proc.returncode}:\n{logs}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not come up in {limit_s:.0f} s")
        time.sleep(0.5)


def test_ray_job_submit_end_to_end(tmp_path, ray_cluster):
    address, env = ray_cluster
    rows = simple_rows(8)
    src = write_prompts(tmp_path / "prompts.parquet", rows)
    out = tmp_path / "out"
    runtime_env = {"env_vars": {"AWS_EC2_METADATA_DISABLED": "true", "OMP_NUM_THREADS": "1", CPU_ENGINE_ENV: "1"}}
    cmd = [
        str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
        "--runtime-env-json", json.dumps(runtime_env), "--",
        "python", "-m", "jobs.generate", "--job-id", "submitted", "--bundle", "random:0",
        "--input", str(src), "--output", str(out), "--num-actors", "2", "--batch-size", "2", "--device", "cuda", "--gpu-wait-s", "0",
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
    assert "succeeded" in logs and "connecting to Ray at" in logs and "ok 8   failed 0" in logs
    tel = pq.read_table(str(out / "telemetry")).to_pylist()
    assert Counter(r["prompt_id"] for r in tel) == Counter(r["prompt_id"] for r in rows)
    # one actor per logical GPU: two actors (as the head's state API lists them, dead ones
    # included), each on its own worker node, none on the head (it has no GPU)
    actors = [a for a in _state(address, "actors") if "GeneratorWorker" in a.get("class_name", "")]
    head = {n["node_id"] for n in _state(address, "nodes") if n.get("is_head_node")}
    on = {a["node_id"] for a in actors}
    assert len(actors) == GPU_NODES and len(on) == GPU_NODES and not on & head, actors
    assert {r["node_id"] for r in tel} <= on
    assert sorted(p.name for p in (out / "images").glob("*.png")) == [f"{r['prompt_id']}.png" for r in rows]
    assert (out / "images" / "metadata.parquet").is_file()  # imagefolder metadata beside the images
    assert json.loads((out / "summary.json").read_text())["ok"] == 8
