"""Chaos runs: the real job on a multi-node Ray cluster while faults are injected at random moments.

    python -m jobs.chaos --runs 20 --seed 0 [--prompts 24] [--faults 2] [--json F]

One cluster for all runs, started by this command on this machine (`ray.cluster_utils.Cluster`:
a head with no CPUs and two worker nodes of 2 CPUs and 1 logical GPU each; engines compute on CPU
through ADT_ENGINE_ON_CPU=1) and one loopback S3 server (moto, in this process). Each run starts
`python -m jobs.generate` as a driver process against that cluster (the embedded random:0 target,
`ar`, outputs under s3://chaos/run-<i>), and a seeded RNG picks its faults and the image counts at
which they fire:

    actor   SIGKILL one of the pool's actor processes (Ray restarts it and retries its batch)
    node    remove a GPU worker node, not gracefully; a fresh one joins 2 s later
    s3      stop the S3 server for 1-4 s (inside the job's storage retry budget), then restart it
            on the same port with its data (moto keeps its state in this process)
    driver  SIGKILL the driver; the same command with resume is started again

After each run the output must hold every prompt exactly once: one image per prompt and no other
image, one telemetry (ledger) row per prompt, all ok, and one imagefolder metadata row per prompt.
One line per run, then a total; exit 0 when every run passed, 1 otherwise. Everything the command
starts it stops by handle or PID. `tests/pipeline/test_chaos.py` runs a short seeded version.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

KINDS = ("actor", "node", "s3", "driver")
BUCKET = "chaos"
NODE = dict(num_cpus=2, num_gpus=1, object_store_memory=80 * 1024**2)
HEAD = dict(num_cpus=0, object_store_memory=80 * 1024**2, include_dashboard=False,
            _system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                            "health_check_initial_delay_ms": 0, "worker_niceness": 0})
DUMMY_AWS = {"AWS_ACCESS_KEY_ID": "chaos", "AWS_SECRET_ACCESS_KEY": "chaos", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true"}
REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunResult:
    run: int
    faults: list[str]  # "kind@images" in the order they fired
    exit_codes: list[int]  # one per driver process (a killed driver, then its resume)
    images: int
    rows: int
    lost: int  # prompts with no image or no ok row
    duplicated: int  # prompts with more than one row (or metadata row)
    extra: int  # images or rows of prompts not in the set
    seconds: float
    passed: bool = False
    problems: list[str] = field(default_factory=list)


# ---- the world the runs share ----------------------------------------------------------------
class S3Server:
    """moto's server on a fixed loopback port; `outage(s)` stops it and starts it again."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._cls = ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.endpoint = f"http://{self.host}:{self.port}"

    def outage(self, seconds: float) -> None:
        self.server.stop()
        time.sleep(seconds)
        self.server = self._cls(ip_address=self.host, port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


class World:
    """The cluster and the S3 server, with the fault each kind injects."""

    def __init__(self, say: Callable[[str], None], cluster=None, gpu_nodes: Optional[list] = None):
        """A cluster of its own, or `cluster` (a running `Cluster` this process is connected to,
        with its GPU worker nodes `gpu_nodes`: the tests' module cluster)."""
        import boto3
        import ray
        from ray.cluster_utils import Cluster

        for k, v in DUMMY_AWS.items():
            os.environ.setdefault(k, v)
        self.s3 = S3Server()
        self.owned = cluster is None
        if self.owned:
            cluster = Cluster(initialize_head=True, connect=False, head_node_args=HEAD)
            gpu_nodes = [cluster.add_node(**NODE) for _ in range(2)]
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)  # to watch the nodes
        self.cluster, self.gpu_nodes = cluster, gpu_nodes
        boto3.client("s3", endpoint_url=self.s3.endpoint).create_bucket(Bucket=BUCKET)
        say(f"[chaos] cluster {cluster.address}: head + {len(gpu_nodes)} GPU nodes "
            f"({NODE['num_cpus']} CPU, 1 logical GPU each); S3 {self.s3.endpoint}")

    def kill_actor(self, rng: random.Random) -> bool:
        actors = pool_actor_pids()
        if not actors:
            return False
        os.kill(rng.choice(actors), signal.SIGKILL)
        return True

    def lose_node(self, rng: random.Random) -> bool:
        node = self.gpu_nodes.pop(rng.randrange(len(self.gpu_nodes)))
        self.cluster.remove_node(node, allow_graceful=False)
        time.sleep(2.0)
        self._add_node()
        return True

    def _add_node(self) -> None:
        import ray._private.utils as ray_utils

        saved = ray_utils.set_sigterm_handler  # node start-up sets a SIGTERM handler: main thread only
        ray_utils.set_sigterm_handler = lambda handler: None
        try:
            self.gpu_nodes.append(self.cluster.add_node(**NODE))
        finally:
            ray_utils.set_sigterm_handler = saved

    def close(self) -> None:
        import ray

        if self.owned:
            ray.shutdown()
            self.cluster.shutdown()
        self.s3.stop()


def pool_actor_pids() -> list[int]:
    """PIDs of the job's pool actors (process title "ray::MapWorker...") that descend from this
    process: the raylets of this command's cluster are its children, so no other Ray is touched."""
    parent: dict[int, int] = {}
    titles: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            titles[int(d.name)] = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def ours(pid: int) -> bool:
        for _ in range(16):
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
            if pid <= 1:
                return False
        return False

    return [p for p, t in titles.items() if t.startswith("ray::MapWorker") and ours(p)]


# ---- one run -------------------------------------------------------------------------------------
def _job_config(world: World, run: int, src: str, resume: bool) -> dict[str, Any]:
    return {"job_id": f"chaos-{run}", "bundle": "random:0", "input": src, "output": f"s3://{BUCKET}/run-{run}",
            "device": "cuda", "gpu_wait_s": 0, "ray_address": world.cluster.address, "num_actors": 2,
            "batch_size": 2, "node_lost_wait_s": 60, "progress": False, "resume": resume,
            "storage": {"endpoint_url": world.s3.endpoint, "retry_budget_s": 60},
            "decode": {"method": "ar", "temperature": 0.0, "batch_size": 2}}


class Driver:
    """`python -m jobs.generate --config <file>` as a process of its own."""

    def __init__(self, cfg: dict[str, Any], folder: Path, tag: str):
        path = folder / f"{tag}.json"
        path.write_text(json.dumps(cfg))
        env = dict(os.environ, ADT_ENGINE_ON_CPU="1", PYTHONPATH=str(REPO), RAY_ADDRESS=cfg["ray_address"], **DUMMY_AWS)
        self.log = open(folder / f"{tag}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "jobs.generate", "--config", str(path)], cwd=REPO,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def _count_images(store) -> int:
    try:
        return sum(k.endswith(".png") for k in store.list_keys("images"))
    except Exception:  # noqa: BLE001 - the store may be down (an s3 fault)
        return -1


def _inject(world: World, kind: str, rng: random.Random, driver: Driver) -> bool:
    if kind == "actor":
        return world.kill_actor(rng)
    if kind == "node":
        return world.lose_node(rng)
    if kind == "s3":
        world.s3.outage(rng.uniform(1.0, 4.0))
        return True
    driver.kill()
    return True


def plan_faults(rng: random.Random, n_faults: int, prompts: int, kinds: tuple[str, ...] = KINDS) -> list[tuple[int, str]]:
    """(image count at which it fires, kind), in firing order: distinct kinds."""
    kinds = rng.sample(kinds, k=min(n_faults, len(kinds)))
    at = sorted(rng.sample(range(2, max(3, prompts - 2)), k=len(kinds)))
    return list(zip(at, kinds))


def run_once(world: World, run: int, seed: int, prompts: int, n_faults: int, folder: Path,
             kinds: tuple[str, ...] = KINDS, limit_s: float = 600) -> RunResult:
    from pipeline.config import StorageSettings
    from pipeline.storage import open_storage

    rng = random.Random(f"{seed}:{run}")
    t0 = time.monotonic()
    src = _prompts(folder / f"prompts-{run}.parquet", prompts, run)
    store = open_storage(f"s3://{BUCKET}/run-{run}", StorageSettings(endpoint_url=world.s3.endpoint))
    faults, fired, codes = plan_faults(rng, n_faults, prompts, kinds), [], []
    for attempt in "ab":  # a: the job; b: the same job resumed, after a driver kill
        driver = Driver(_job_config(world, run, src, resume=attempt == "b"), folder, f"run-{run}-{attempt}")
        killed = False
        while driver.proc.poll() is None and time.monotonic() - t0 < limit_s:
            if faults and _count_images(store) >= faults[0][0]:
                at, kind = faults.pop(0)
                if _inject(world, kind, rng, driver):
                    fired.append(f"{kind}@{at}")
                    killed |= kind == "driver"
            time.sleep(0.2)
        codes.append(driver.wait(max(1.0, limit_s - (time.monotonic() - t0))))
        if not killed:
            break
    res = check_output(store, [f"c{run}-{i:03d}" for i in range(prompts)])
    res.update(run=run, faults=fired, exit_codes=codes, seconds=round(time.monotonic() - t0, 1))
    out = RunResult(**res)
    if codes[-1] != 0:
        out.problems.append(f"exit {codes[-1]} (log: {folder}/run-{run}-{'ab'[len(codes) - 1]}.log)")
    out.passed = not out.problems
    return out


def _prompts(path: Path, n: int, run: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt_id": [f"c{run}-{i:03d}" for i in range(n)],
                             "prompt": [f"a chaos face {i}" for i in range(n)], "seed": list(range(n))}), path)
    return str(path)


def check_output(store, ids: list[str]) -> dict[str, Any]:
    """Every prompt exactly once: images, telemetry (ledger) rows, imagefolder metadata rows."""
    from pipeline.ledger import read_telemetry
    from pipeline.storage import image_key

    want = set(ids)
    images = {k for k in store.list_keys("images") if k.endswith(".png")}
    tel = read_telemetry(store, columns=["prompt_id", "status"])
    rows = Counter(tel["prompt_id"].to_pylist()) if tel is not None else Counter()
    ok = {r["prompt_id"] for r in tel.to_pylist() if r["status"] == "ok"} if tel is not None else set()
    meta = Counter()
    if store.exists("images/metadata.parquet"):
        meta = Counter(r["file_name"] for r in store.read_parquet("images/metadata.parquet").to_pylist())
    problems = []
    lost = {i for i in want if image_key(i) not in images or i not in ok}
    dup = {i for i, c in rows.items() if c > 1} | {f for f, c in meta.items() if c > 1}
    extra = (images - {image_key(i) for i in want}) | (set(rows) - want)
    if lost:
        problems.append(f"lost {sorted(lost)[:5]}")
    if dup:
        problems.append(f"duplicated {sorted(dup)[:5]}")
    if extra:
        problems.append(f"extra {sorted(extra)[:5]}")
    if meta and sum(meta.values()) != len(want):
        problems.append(f"metadata rows {sum(meta.values())} != {len(want)}")
    return {"images": len(images), "rows": sum(rows.values()), "lost": len(lost), "duplicated": len(dup),
            "extra": len(extra), "problems": problems}


def line(r: RunResult) -> str:
    verdict = "ok  " if r.passed else "FAIL"
    return (f"[chaos] run {r.run:2d} {verdict} faults {','.join(r.faults) or '-':<24} exit {r.exit_codes} "
            f"images {r.images} rows {r.rows} lost {r.lost} duplicated {r.duplicated} extra {r.extra} "
            f"{r.seconds:.0f}s" + (f"  ({'; '.join(r.problems)})" if r.problems else ""))


def total(results: list[RunResult]) -> str:
    kinds = Counter(f.split("@")[0] for r in results for f in r.faults)
    return (f"[chaos] total: {sum(r.passed for r in results)}/{len(results)} runs passed; faults injected "
            + ", ".join(f"{k} {kinds.get(k, 0)}" for k in KINDS)
            + f"; images lost {sum(r.lost for r in results)}, duplicated {sum(r.duplicated for r in results)}")


def chaos(runs: int, seed: int, prompts: int, n_faults: int, say: Callable[[str], None] = print,
          json_path: Optional[str] = None, kinds: tuple[str, ...] = KINDS, world: Optional[World] = None) -> list[RunResult]:
    folder = Path(tempfile.mkdtemp(prefix="chaos-"))
    own = world is None
    world = world or World(say)
    results = []
    try:
        for run in range(runs):
            r = run_once(world, run, seed, prompts, n_faults, folder, kinds)
            results.append(r)
            say(line(r))
            if json_path:
                with open(json_path, "a") as f:
                    f.write(json.dumps(asdict(r)) + "\n")
    finally:
        if own:
            world.close()
    say(total(results))
    say(f"[chaos] driver logs and prompt files: {folder}")
    return results


def main(argv: Optional[list[str]] = None) -> int:
    from pipeline.cli import CliParser

    p = CliParser("python -m jobs.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=24, help="prompts per run")
    p.add_argument("--faults", type=int, default=2, help="faults per run (distinct kinds, 1-4)")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds to draw from (comma-separated)")
    p.add_argument("--json", help="append one JSON line per run here")
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds: choose from {','.join(KINDS)}")
    results = chaos(a.runs, a.seed, a.prompts, max(1, min(4, a.faults)), json_path=a.json, kinds=kinds)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
