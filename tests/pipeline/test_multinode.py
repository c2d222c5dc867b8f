"""The job on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`: real raylets on this
machine): a head with no CPUs and two GPU worker nodes of 2 CPUs and 1 logical GPU each. Actors
reserve the logical GPUs (num_gpus=1) and their engines compute on CPU (the documented test
override ADT_ENGINE_ON_CPU=1). One cluster for the module; the driver (this process) stays
connected to it, and the session's in-process Ray is restarted afterwards.

- one job: one actor per GPU spread over the nodes (node and GPU id asserted per actor), an
  actor SIGKILLed mid-batch and a GPU node removed mid-run -> exit 0, every prompt exactly
  once (images, telemetry rows), restarts counted;
- every GPU node lost mid-run -> exit 3 with one error line; a GPU node joins; --resume does
  only what is missing, on it;
- one GPU node for --num-actors 2, a second joining mid-run: the pool grows onto it (its rows
  and its actor on the new node), every prompt exactly once, exit 0;
- a short seeded jobs.chaos run (S3 server restarted, driver killed and resumed).
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fault_worker import kill_once_worker, paced_worker, placed, placements
from pipeline.config import build_config
from pipeline.driver import run_job
from pipeline.execute import CPU_ENGINE_ENV
from pipeline.exit_codes import EXIT_NO_RESOURCES, EXIT_OK
from pipeline_helpers import simple_rows, write_prompts

pytestmark = pytest.mark.slow

NODE = dict(num_cpus=2, num_gpus=1, object_store_memory=80 * 1024**2)
GROW_PROMPTS = 30  # at GROW_PACE_S an image, one actor alone takes 60 s: room for a slow growth
GROW_PACE_S = 2.0
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0,
               "worker_niceness": 0}


def _start(make):
    """Ray gives a starting node 30 s to register (fixed in ray/_private/node.py): on a loaded
    machine that can pass; try once more."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001
        if "timed out during startup" not in str(e):
            raise
        return make()


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from session_ray import DUMMY_AWS, init_session_ray

    had_session = ray.is_initialized()
    if had_session:
        ray.shutdown()
    saved_env = {k: os.environ.get(k) for k in DUMMY_AWS}
    os.environ.update(DUMMY_AWS)  # the raylets' environment: actors of jobs from other drivers (jobs.chaos) too
    c = _start(lambda: Cluster(initialize_head=True, connect=False,
                               head_node_args=dict(num_cpus=0, object_store_memory=80 * 1024**2,
                                                   include_dashboard=False, _system_config=FAST_HEALTH)))
    c.gpu_nodes = [_start(lambda: c.add_node(**NODE)) for _ in range(2)]
    c.wait_for_nodes()
    saved = os.environ.get(CPU_ENGINE_ENV)
    os.environ[CPU_ENGINE_ENV] = "1"
    ray.init(address=c.address, runtime_env={"env_vars": dict(DUMMY_AWS)}, log_to_driver=True)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in [(CPU_ENGINE_ENV, saved), *saved_env.items()]:
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if had_session:
            init_session_ray()


# The thread that starts every node added during the tests. Ray starts a raylet with
# PR_SET_PDEATHSIG (fate sharing), which Linux ties to the creating *thread*: a node started from a
# watcher thread is SIGKILLed when that thread ends (the GCS then marks it dead 1.5 s later). This
# thread lives as long as the test process.
_NODE_STARTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node-starter")


def _add_gpu_node(cluster):
    """A GPU node joins, started from _NODE_STARTER (callable from any thread)."""
    return _NODE_STARTER.submit(_start_gpu_node, cluster).result()


def _start_gpu_node(cluster):
    """Ray's node start-up sets a SIGTERM handler, which only the main thread may: skipped here
    (the test process keeps its own)."""
    import ray._private.utils as ray_utils

    saved = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        node = cluster.add_node(**NODE)
    finally:
        ray_utils.set_sigterm_handler = saved
    cluster.gpu_nodes.append(node)
    return node


def _job(tmp_path, cluster, n, **over):
    src = write_prompts(tmp_path / "p.parquet", simple_rows(n))
    data = {"job_id": "mn", "bundle": "random:0", "input": str(src), "output": str(tmp_path / "out"),
            "device": "cuda", "gpu_wait_s": 0, "ray_address": cluster.address, "batch_size": 2,
            "decode": {"method": "ar", "temperature": 0.0, "batch_size": 2}, "progress": False}
    data.update(over)
    return build_config(data)


def _images(out: Path) -> list[str]:
    d = out / "images"
    return sorted(p.name for p in d.iterdir() if p.name != "metadata.parquet") if d.is_dir() else []


def _rows(out: Path) -> Counter:
    ids: list[str] = []
    for f in (out / "telemetry").glob("*.parquet"):
        ids += pq.read_table(f, columns=["prompt_id"])["prompt_id"].to_pylist()
    return Counter(ids)


def _when_images(out: Path, n: int, then) -> threading.Thread:
    def watch():
        deadline = time.monotonic() + 300
        while len(_images(out)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        then()
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _alive_gpu_nodes():
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]


def test_actors_placed_per_gpu_survive_a_killed_actor_and_a_lost_node(tmp_path, cluster):
    rows = simple_rows(24)
    out = tmp_path / "out"
    probe = tmp_path / "placed"
    probe.mkdir()
    worker = placed(type("PacedKill", (kill_once_worker(tmp_path / "killed"), paced_worker(0.3)), {}), probe)
    cfg = _job(tmp_path, cluster, len(rows), num_actors=2)
    first_nodes = {n["NodeID"] for n in _alive_gpu_nodes()}
    lost = []

    def lose_one():
        node = cluster.gpu_nodes.pop(0)
        lost.append(node.node_id)
        cluster.remove_node(node, allow_graceful=False)

    watcher = _when_images(out, 6, lose_one)
    text = io.StringIO()
    res = run_job(cfg, stream=text, worker=worker)
    watcher.join()
    log = text.getvalue()
    assert res.exit_code == EXIT_OK, log[-3000:]
    assert (tmp_path / "killed").exists() and lost  # both faults fired
    # every prompt exactly once: one image each, one telemetry row each
    assert _images(out) == [f"{r['prompt_id']}.png" for r in rows]
    assert _rows(out) == Counter(r["prompt_id"] for r in rows)
    s = res.summary
    assert (s["ok"], s["failed"], s["job_ok"]) == (24, 0, 24)
    assert s["actor_restarts"] >= 1 and "actor restart(s)" in log
    # placement: an actor on each GPU node, each holding that node's one logical GPU, engine on CPU
    placed_at = placements(probe)
    assert {p["node_id"] for p in placed_at if p["node_id"] in first_nodes} == first_nodes
    assert all(p["gpu_ids"] == ["0"] and p["device"] == "cpu" for p in placed_at)


def test_every_gpu_node_lost_exits_3_in_one_line_and_resume_does_only_the_rest(tmp_path, cluster):
    rows = simple_rows(16)
    out = tmp_path / "out"
    cfg = _job(tmp_path, cluster, len(rows), num_actors=len(cluster.gpu_nodes), node_lost_wait_s=2)

    def lose_all():
        while cluster.gpu_nodes:
            cluster.remove_node(cluster.gpu_nodes.pop(), allow_graceful=False)

    watcher = _when_images(out, 3, lose_all)
    text = io.StringIO()
    res = run_job(cfg, stream=text, worker=paced_worker(0.3))
    watcher.join()
    log = text.getvalue()
    assert res.exit_code == EXIT_NO_RESOURCES, log[-3000:]
    errors = [ln for ln in log.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "left the cluster" in errors[0] and "--resume" in errors[0], errors
    assert "Traceback" not in log and res.summary["status"] == "cluster lost"
    done = _rows(out)
    assert 1 <= len(done) < len(rows) and max(done.values()) == 1  # rows of images stored just before may be lost with the nodes

    joined = [_add_gpu_node(cluster).node_id]  # GPU capacity is back: the resume does the rest on it
    again_text = io.StringIO()
    again = run_job(cfg.model_copy(update={"resume": True}), stream=again_text)
    assert again.exit_code == EXIT_OK, again_text.getvalue()[-3000:]
    assert (again.summary["skipped"], again.summary["processed"]) == (len(done), len(rows) - len(done))
    assert _rows(out) == Counter(r["prompt_id"] for r in rows)
    assert _images(out) == [f"{r['prompt_id']}.png" for r in rows]
    new_rows = pq.read_table(out / "telemetry", columns=["run_id", "node_id"]).to_pylist()
    assert {r["node_id"] for r in new_rows if r["run_id"] == again.summary["run_id"]} == set(joined)


def _keep_gpu_nodes(cluster, n: int) -> None:
    """Remove (gracefully) or add GPU nodes until `n` are alive."""
    while len(cluster.gpu_nodes) > n:
        cluster.remove_node(cluster.gpu_nodes.pop(), allow_graceful=True)
    while len(cluster.gpu_nodes) < n:
        _add_gpu_node(cluster)
    deadline = time.monotonic() + 60
    while len(_alive_gpu_nodes()) != n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_alive_gpu_nodes()) == n


def test_a_gpu_node_joining_mid_run_grows_the_pool_onto_it(tmp_path, cluster):
    """One GPU node alive, --num-actors 2: the pool starts with 1 actor and may grow to 2
    (ActorPoolStrategy(min_size=1, max_size=2)); a GPU node joins after 2 images and the pool
    grows onto it. Images take GROW_PACE_S until an actor is ready on the joined node, 0.3 s
    after: the job runs as long as the growth takes and no longer (and ends anyway, failing
    here, if the pool never grows). Leaves the module's cluster with as many GPU nodes as it
    found."""
    found = len(cluster.gpu_nodes)
    try:
        _keep_gpu_nodes(cluster, 1)
        first = cluster.gpu_nodes[0].node_id
        rows = simple_rows(GROW_PROMPTS)
        out, probe, grown = tmp_path / "out", tmp_path / "placed", tmp_path / "grown"
        probe.mkdir()
        cfg = _job(tmp_path, cluster, len(rows), num_actors=2)
        joined: list[tuple[str, float]] = []

        def join_and_wait_for_its_actor():
            node = _add_gpu_node(cluster)
            joined.append((node.node_id, time.time()))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not any(p["node_id"] == node.node_id for p in placements(probe)):
                time.sleep(0.2)
            grown.touch()

        watcher = _when_images(out, 2, join_and_wait_for_its_actor)
        text = io.StringIO()
        res = run_job(cfg, stream=text, worker=placed(paced_worker(GROW_PACE_S, until=grown, then_s=0.3), probe))
        watcher.join()
        log = text.getvalue()
        assert res.exit_code == EXIT_OK, log[-3000:]
        assert "2 actors requested, 1 GPUs fit 1 now: the pool grows as GPU nodes join" in log, log[-3000:]
        assert len(joined) == 1, "the GPU node did not join (its start failed in the watcher thread)"
        (new, joined_at), = joined
        # every prompt exactly once: one image, one telemetry (ledger) row, one metadata row each
        want = Counter(r["prompt_id"] for r in rows)
        assert _images(out) == [f"{p}.png" for p in sorted(want)]
        assert _rows(out) == want
        meta = pq.read_table(out / "images" / "metadata.parquet", columns=["file_name"])["file_name"].to_pylist()
        assert Counter(meta) == Counter(f"{p}.png" for p in want)
        s = res.summary
        assert (s["ok"], s["failed"], s["actor_restarts"], s["num_actors"], s["engine_actors"]) == (len(rows), 0, 0, 1, 2)
        # the pool grew onto the joined node: rows from both nodes, one actor on each node's GPU
        done = pq.read_table(out / "telemetry", columns=["node_id", "finished_at"]).to_pylist()
        assert {r["node_id"] for r in done} == {first, new}
        actors = placements(probe)
        assert sorted(p["node_id"] for p in actors) == sorted([first, new])
        assert len({(p["node_id"], tuple(p["gpu_ids"])) for p in actors}) == 2
        assert all(p["gpu_ids"] == ["0"] and p["device"] == "cpu" for p in actors)
        ready = next(p["ready_at"] for p in actors if p["node_id"] == new)
        first_row = min(r["finished_at"].timestamp() for r in done if r["node_id"] == new)
        print(f"[grow] node joined {joined_at - min(p['ready_at'] for p in actors):.1f} s after the first actor was "
              f"ready; its actor ready {ready - joined_at:.1f} s after it joined, its first row "
              f"{first_row - joined_at:.1f} s after; rows per node: "
              f"{dict(Counter('joined' if r['node_id'] == new else 'first' for r in done))}; "
              f"job {s['job_wall_time_s']:.1f} s")
    finally:
        _keep_gpu_nodes(cluster, found)


def test_chaos_short_seeded_run_loses_and_duplicates_nothing(cluster):
    """jobs.chaos on this module's cluster: one seeded run of the real job CLI (a driver
    process) with the S3 server stopped and restarted and the driver SIGKILLed and resumed (the
    actor and node faults are the tests above); the long run is `python -m jobs.chaos --runs 20`."""
    from jobs.chaos import World, chaos

    lines: list[str] = []
    world = World(lines.append, cluster=cluster, gpu_nodes=cluster.gpu_nodes)
    try:
        results = chaos(runs=1, seed=3, prompts=10, n_faults=2, say=lines.append, kinds=("s3", "driver"), world=world)
    finally:
        world.close()
    (r,) = results
    assert r.passed and sorted(f.split("@")[0] for f in r.faults) == ["driver", "s3"], lines
    assert (r.lost, r.duplicated, r.extra, r.images, r.rows) == (0, 0, 0, 10, 10) and r.exit_codes[-1] == 0
    assert lines[-2].startswith("[chaos] total: 1/1 runs passed")
