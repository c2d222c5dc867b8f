"""How the pipeline itself scales with the prompt count: a synthetic prompt set (made here, not
shipped) through the real job (pipeline.driver.run_job: prompt read and selection, Ray Data's
actor pool, the driver's row sink and ledger, compaction, summary) with a stand-in engine that
costs nothing: `NullWorker`, a benchmark-only actor class that answers each prompt with an ok
row at once (no model; with --images, a constant 1x1 PNG stored under the prompt's key like a
real image). What it measures is the pipeline's ceiling, not a model's speed.

    python -m jobs.scale --rows 10000,100000,1000000 [--s3 ENDPOINT|moto] [--images] [--json F]
    python -m jobs.scale --rows 10000000 --rows-per-file 1000000 [--window 1000000]
    make scale

Per size: rows/s while the pool ran, time to the first durable row, the driver's peak RSS,
the object store's peak use, the ledger's parts / bytes / write rate, and a resume from a
ledger holding the first half (its selection time: what it read).
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.cli import CliParser
from pipeline.config import JobConfig, build_config
from pipeline.storage import image_key, open_storage
from pipeline.telemetry import STATUS_OK, RowContext, _base_row
from pipeline.worker import _ray_context, pack

PNG_1x1 = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                        "1f15c4890000000d4944415478da63f8cfc0f01f0005000201e2215bc40000000049454e44ae426082")


class NullWorker:
    """Benchmark-only stand-in for GeneratorWorker: one ok row per prompt, no engine."""

    def __init__(self, config: dict, device: Optional[str] = None, num_threads: Optional[int] = None,
                 run_id: Optional[str] = None):
        self.cfg = JobConfig.model_validate(config)
        self.images = os.environ.get("ADT_SCALE_IMAGES") == "1"
        self.storage = open_storage(self.cfg.output, self.cfg.storage) if self.images else None
        actor, node, _ = _ray_context()
        self.ctx = RowContext(job_id=self.cfg.job_id, bundle="null", method=self.cfg.decode.method,
                              config_hash=self.cfg.config_hash(), run_id=run_id, actor_id=actor, node_id=node)

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        rows = []
        for pid, seed in zip(batch["prompt_id"].to_pylist(), batch["seed"].to_pylist()):
            row = _base_row(self.ctx, pid, seed, None)
            if self.images:
                row["image_key"] = image_key(pid)
                self.storage.put_bytes(row["image_key"], PNG_1x1, "image/png")
            row["status"] = STATUS_OK
            rows.append(row)
        yield pack(rows)


def make_prompts(path: Path, n: int, per_file: Optional[int] = None) -> Path:
    """n synthetic prompts (prompt_id s000000000.., prompt, seed) in one Parquet file at `path`
    (or, with `per_file` < n, a folder `path` of files of `per_file` rows, in id order), written
    in slices of 10^6 rows with Arrow kernels (no Python string a row in the driver's process)."""
    schema = pa.schema([("prompt_id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64())])
    per_file = per_file if per_file and per_file < n else n
    if per_file < n:
        path.mkdir(parents=True)
    for f, first in enumerate(range(0, n, per_file)):
        target = path / f"part-{f:05d}.parquet" if per_file < n else path
        with pq.ParquetWriter(target, schema) as w:
            for start in range(first, min(n, first + per_file), 1_000_000):
                seq = pa.array(np.arange(start, min(n, first + per_file, start + 1_000_000), dtype=np.int64))
                ids = pc.binary_join_element_wise("s", pc.utf8_lpad(pc.cast(seq, pa.string()), 9, "0"), "")
                text = pc.binary_join_element_wise("a smiling face number ", pc.cast(pc.remainder(seq, 977), pa.string()), "")
                w.write_table(pa.table({"prompt_id": ids, "prompt": text, "seed": seq}, schema=schema))
    pa.default_memory_pool().release_unused()  # the driver's RSS is measured from here on
    return path


def _rss_bytes() -> int:
    """This process's resident set size now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler:
    """Peak driver RSS and object-store use, sampled every `every_s` in a thread."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.rss = self.store = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import ray

        while not self._stop.wait(self.every_s):
            self.rss = max(self.rss, _rss_bytes())
            try:
                if ray.is_initialized():
                    total = ray.cluster_resources().get("object_store_memory", 0)
                    free = ray.available_resources().get("object_store_memory", total)
                    self.store = max(self.store, total - free)
            except Exception:  # noqa: BLE001 - sampling only
                pass

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _ledger(out: str, cfg: JobConfig) -> dict[str, Any]:
    store = open_storage(out, cfg.storage)
    keys = [k for k in store.list_keys("telemetry") if k.endswith(".parquet")]
    return {"files": len(keys)}


def run_size(n: int, root: Path, output: str, actors: int, images: bool, storage: dict,
             full_run: bool = True, window: Optional[int] = None, per_file: Optional[int] = None) -> dict[str, Any]:
    """One size: a full run (unless not `full_run`; with `window`, a run of the first `window`
    prompts of the n-row file: its start-up reads and selects all n, its rows/s is a steady
    window), then a run of the first half and a resume of the rest (into {output}/half_{n})."""
    from pipeline.driver import run_job

    src = make_prompts(root / f"prompts_{n}.parquet", n, per_file)
    os.environ["ADT_SCALE_IMAGES"] = "1" if images else "0"
    rows_per_call = max(64, min(4096, n // (actors * 16)))
    base = {"job_id": "scale", "bundle": "random:0", "input": str(src), "num_actors": actors,
            "batch_size": rows_per_call, "decode": {"method": "ar"}, "progress": False, "device": "cpu",
            "progress_interval_s": 3600, "storage": storage}
    got: dict[str, Any] = {"rows": n, "rows_per_call": rows_per_call, "prompt_files": math.ceil(n / min(per_file or n, n))}
    if window:
        got["window"] = window
    if full_run:  # first: the driver's RSS is measured in a process no earlier run has used
        full = build_config(base | {"output": f"{output}/full_{n}", "limit": window})
        with _Sampler() as s:
            t0 = time.perf_counter()
            res = run_job(full, stream=io.StringIO(), worker=NullWorker)
            job_s = time.perf_counter() - t0
        assert res.exit_code == 0 and res.summary["ok"] == (window or n), res.summary
        exec_s = res.summary["wall_time_s"]
        got.update(rows_per_s=(window or n) / exec_s, pool_s=exec_s, job_s=job_s, start_s=job_s - exec_s,
                   first_row_s=res.summary["first_row_s"], driver_rss_mb=s.rss / 2**20,
                   object_store_peak_mb=s.store / 2**20, ledger_parts=res.summary["ledger_parts"],
                   **_ledger(f"{output}/full_{n}", full))
    half = build_config(base | {"output": f"{output}/half_{n}", "limit": max(1, n // 2)})
    first = run_job(half, stream=io.StringIO(), worker=NullWorker)
    assert first.exit_code == 0 and first.summary["ok"] == n // 2, first.summary
    with _Sampler() as resume_mem:
        t1 = time.perf_counter()
        again = run_job(half.model_copy(update={"limit": None, "resume": True}), stream=io.StringIO(),
                        worker=NullWorker)
        resume_s = time.perf_counter() - t1
    assert again.exit_code == 0 and again.summary["skipped"] == n // 2 and again.summary["job_ok"] == n, again.summary
    assert again.summary["ok"] == n - n // 2, again.summary
    resume = {"resume_s": resume_s, "resume_start_s": again.summary["job_wall_time_s"] - again.summary["wall_time_s"],
              "resume_rss_mb": resume_mem.rss / 2**20, "resume_rows_per_s": again.summary["images_per_second"]}
    return got | resume


def plot(jsonl: str, chart: str) -> None:
    """Log-log panels of each figure against the prompt count, one line per store and code tag
    (a colour per store; dashed: code=before)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    panels = [("rows_per_s", "rows/s (pool)"), ("start_s", "job - pool s (start-up + end)"),
              ("driver_rss_mb", "driver RSS MB"), ("resume_start_s", "resume start-up s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    lines = sorted({(r["store"], r.get("code", "")) for r in runs})
    for ax, (key, title) in zip(axes, panels):
        for store, code in lines:
            pts = sorted((r["rows"], r[key]) for r in runs
                         if (r["store"], r.get("code", "")) == (store, code) and r.get(key))
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="--" if code == "before" else "-",
                        color="C0" if store == "local" else "C1", label=f"{store} {code}".strip())
        ax.set(xscale="log", yscale="log", title=title, xlabel="prompts")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("jobs.scale: the pipeline with a null engine (NullWorker), 2 actors", fontsize=10)
    fig.tight_layout()
    Path(chart).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(chart, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    p = CliParser("python -m jobs.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="10000,100000", help="comma-separated prompt counts")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--window", type=int, help="the full run does only the first WINDOW prompts of each size's file "
                   "(start-up over all of them, rows/s over a steady window); the half run and resume stay whole")
    p.add_argument("--rows-per-file", type=int, help="write each prompt set as files of this many rows (default: one file)")
    p.add_argument("--images", action="store_true", help="store a constant 1x1 PNG per prompt")
    p.add_argument("--s3", metavar="ENDPOINT", help="write to this S3-compatible endpoint (bucket 'scale'); "
                   "'moto' starts a loopback server in this process")
    p.add_argument("--json", help="append one JSON line per size here")
    p.add_argument("--code", default="", help="a tag written into each JSON line (e.g. before / after a change)")
    p.add_argument("--plot", metavar="JSONL", help="only draw the log-log figure of these JSON lines (to --chart)")
    p.add_argument("--chart", default="docs/img/scale.png", help="where --plot writes the figure")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot, args.chart)
        return 0
    root = Path(tempfile.mkdtemp(prefix="scale"))
    storage: dict = {}
    output = str(root / "out")
    server = None
    if args.s3:
        import boto3

        endpoint = args.s3
        if endpoint == "moto":  # a loopback S3-compatible server in this process, dummy credentials
            from moto.server import ThreadedMotoServer

            for k, v in {"AWS_ACCESS_KEY_ID": "scale", "AWS_SECRET_ACCESS_KEY": "scale",
                         "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
                os.environ.setdefault(k, v)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            endpoint = "http://%s:%d" % server.get_host_and_port()
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="scale")
        storage, output = {"endpoint_url": endpoint}, "s3://scale/run"
    try:
        for n in [int(x) for x in args.rows.split(",")]:
            got = run_size(n, root, output, args.actors, args.images, storage, window=args.window,
                           per_file=args.rows_per_file)
            got["store"] = "s3" if args.s3 else "local"
            if args.code:
                got["code"] = args.code
            print(json.dumps(got), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(got) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
