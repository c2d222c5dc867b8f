"""The job driver: prompts (Parquet) -> Ray Data actor pool of GeneratorWorkers -> telemetry.

    read_parquet(prompts) -> keep the selected ids (limit, resume) -> repartition so every
    actor gets work -> map_batches(GeneratorWorker, ActorPoolStrategy(size=N), GPUs or
    fractional CPUs per actor) -> write_parquet(<output>/telemetry/<run id>_*.parquet)

then `summary.json` and a one-screen summary. Everything that can be refused is refused
before Ray starts: the config, the prompt input's structure, the cluster's resources.

Output layout (rooted at JobConfig.output, a path or s3:// prefix):

    job.json                 the JobConfig with its config_hash
    images/<id>.png          one image per ok prompt (id sanitised by storage.safe_name)
    telemetry/<run>_*.parquet one row per processed prompt (pipeline.telemetry.SCHEMA)
    summary.json             counts, throughput, speedups of the latest run
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import ConfigError, JobConfig
from pipeline.prompts import PromptSource, done_ids, open_prompts, read_telemetry, select_ids
from pipeline.storage import Storage, is_remote, open_storage, parse_uri
from pipeline.telemetry import SCHEMA, TELEMETRY_DIR, empty_table, format_summary, latest_per_prompt, summarize
from pipeline.worker import FAULT_ENV, GeneratorWorker

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ROWS_FAILED, EXIT_BAD_INPUT, EXIT_NO_RESOURCES = 0, 1, 2, 3
LOCAL_OBJECT_STORE_BYTES = 1024**3
ROWS_PER_TELEMETRY_FILE = 512


class JobRefused(Exception):
    """The job cannot start; nothing was generated. `exit_code` says why."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class ActorPlan:
    """How the actor pool is placed on the cluster."""

    device: str  # "cuda" | "cpu"
    num_actors: int
    num_gpus: float  # per actor
    num_cpus: float  # per actor
    threads: int  # torch intra-op threads per actor
    notes: list[str] = field(default_factory=list)


@dataclass
class JobResult:
    summary: dict[str, Any]
    exit_code: int
    output_uri: str


def plan_actors(cfg: JobConfig, resources: dict[str, float]) -> ActorPlan:
    """Decide GPUs/CPUs per actor from the cluster's resources, so the pool can always be
    scheduled and read/write tasks keep a CPU (the 2-core deadlock in ray_notes)."""
    gpus = float(resources.get("GPU", 0.0))
    cpus = float(resources.get("CPU", 0.0))
    n = cfg.num_actors
    notes: list[str] = []
    if cfg.device == "cuda" and gpus < cfg.gpus_per_actor:
        raise JobRefused(f"device 'cuda' requested but the cluster has {gpus:g} GPU(s) "
                         f"(need {cfg.gpus_per_actor:g} per actor); use --device auto or cpu", EXIT_NO_RESOURCES)
    if cpus <= 0:
        raise JobRefused("the Ray cluster reports no CPUs", EXIT_NO_RESOURCES)
    if cfg.device != "cpu" and gpus >= cfg.gpus_per_actor:
        fit = int(gpus // cfg.gpus_per_actor)
        if fit < n:
            notes.append(f"{n} actors requested but {gpus:g} GPUs fit {fit}: running {fit}")
            n = fit
        per_cpu = min(1.0, max(0.1, (cpus - 1.0) / n)) if cpus > 1 else cpus / (2 * n)
        return ActorPlan("cuda", n, cfg.gpus_per_actor, per_cpu, 1, notes)
    if cfg.device == "auto":
        notes.append(f"no GPUs in the cluster: running {n} CPU actor(s)")
    spare = 1.0 if cpus >= 2 else cpus / 2  # left for read, repartition and write tasks
    budget = cpus - spare
    if cfg.cpus_per_actor is not None:
        per_cpu = cfg.cpus_per_actor
        if n * per_cpu > budget + 1e-9:
            raise JobRefused(
                f"{n} actors x {per_cpu:g} CPUs leaves no CPU for the read/write tasks on a cluster with "
                f"{cpus:g} CPUs (the job would hang): lower num_actors or cpus_per_actor", EXIT_NO_RESOURCES)
    else:
        per_cpu = budget / n
    threads = max(1, int(per_cpu))
    return ActorPlan("cpu", n, 0.0, round(per_cpu, 4), threads, notes)


def _absolute(cfg: JobConfig) -> JobConfig:
    """Local paths become absolute, so actors (another cwd) and job.json agree."""
    upd = {}
    for name in ("input", "output"):
        value = getattr(cfg, name)
        if not is_remote(value):
            upd[name] = parse_uri(value).path
    return cfg.model_copy(update=upd)


def _check_engine_config(cfg: JobConfig) -> None:
    """Let the engine validate the decode settings now, not inside every actor."""
    try:
        from adt_core import DecodeConfig

        DecodeConfig.from_dict(cfg.decode.engine_dict("cpu"))
    except (ValueError, TypeError) as e:
        raise JobRefused(f"invalid job config:\n  decode: {e}") from None


def _check_bundle(cfg: JobConfig) -> None:
    """A bundle name or path must resolve here (the driver runs beside the workers' image)."""
    if cfg.bundle == "random" or cfg.bundle.startswith("random:"):
        return
    from adt_core.models.bundle import resolve_bundle_dir

    try:
        resolve_bundle_dir(cfg.bundle)
    except (FileNotFoundError, OSError) as e:
        raise JobRefused(f"bundle {cfg.bundle!r} not found: {e} (use --bundle random for a tiny random model)") from None


def _keep_ids(batch: pa.Table, ids: pa.Array) -> pa.Table:
    return batch.filter(pc.is_in(batch["prompt_id"], value_set=ids))


class _Printer:
    def __init__(self, stream: TextIO):
        self.stream = stream

    def __call__(self, msg: str) -> None:
        print(f"[generate] {msg}", file=self.stream, flush=True)


def _init_ray(cfg: JobConfig, say: _Printer) -> bool:
    """Connect to (or start) Ray; returns True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        say(f"connecting to Ray at {address}")
        ray.init(address=address, log_to_driver=True)
    else:
        say("starting a local Ray in this process")
        ray.init(object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False, log_to_driver=True)
    return True


def _execute(cfg: JobConfig, source: PromptSource, todo: list[str], output: Storage, run_id: str,
             say: _Printer) -> ActorPlan:
    import ray
    from ray.data import ActorPoolStrategy, DataContext
    from ray.data.datasource import FilenameProvider

    plan = plan_actors(cfg, ray.cluster_resources())
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1 and not is_remote(cfg.output):
        say(f"WARNING: {len(nodes)} nodes but a local output path: images land on each worker's own disk")
    for note in plan.notes:
        say(note)
    say(f"{len(todo)} prompt(s) to generate on {plan.num_actors} {plan.device} actor(s) "
        f"({plan.num_gpus:g} GPU, {plan.num_cpus:g} CPU each), batch size {cfg.batch_size}")

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = cfg.progress
    if ctx.wait_for_min_actors_s < 0:
        ctx.wait_for_min_actors_s = 1800  # fail rather than hang when actors cannot be placed

    ds = ray.data.read_parquet(source.paths, filesystem=source.filesystem).select_columns(source.columns)
    if len(todo) < len(source.ids):
        ds = ds.map_batches(_keep_ids, fn_kwargs={"ids": pa.array(todo, pa.string())}, batch_format="pyarrow")
    # Small prompt files arrive as one block (one actor would get everything): split by rows.
    per_block = max(1, min(cfg.batch_size, math.ceil(len(todo) / (plan.num_actors * 4))))
    ds = ds.repartition(target_num_rows_per_block=per_block)
    ds = ds.map_batches(
        GeneratorWorker,
        fn_constructor_kwargs={
            "config": cfg.model_dump(mode="json"),
            "device": plan.device,
            "fault": os.environ.get(FAULT_ENV),
            "num_threads": plan.threads,
        },
        batch_size=cfg.batch_size,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=plan.num_actors),
        num_gpus=plan.num_gpus or None,
        num_cpus=plan.num_cpus,
    )
    ds.write_parquet(
        output.arrow_path(TELEMETRY_DIR),
        filesystem=output.arrow_fs(),
        filename_provider=FilenameProvider(dataset_uuid=run_id, file_format="parquet"),
        min_rows_per_file=ROWS_PER_TELEMETRY_FILE,
        schema=SCHEMA,
    )
    return plan


def run_job(cfg: JobConfig, stream: TextIO = sys.stdout) -> JobResult:
    """Run one generation job end to end; raises JobRefused (nothing done) or returns the
    summary and the exit code (non-zero when rows failed, unless allow_failures)."""
    t_job = time.perf_counter()
    say = _Printer(stream)
    cfg = _absolute(cfg)
    _check_engine_config(cfg)
    _check_bundle(cfg)
    output = open_storage(cfg.output, cfg.storage)
    try:
        source = open_prompts(cfg.input, cfg.storage)
    except ValueError as e:
        raise JobRefused(str(e)) from None
    existing = output.list_keys(TELEMETRY_DIR)
    if existing and not cfg.resume:
        raise JobRefused(f"{output.uri_for(TELEMETRY_DIR)} already holds telemetry from an earlier run: "
                         f"pass --resume to continue that job, or choose another --output")
    done = done_ids(output) if cfg.resume else set()
    todo, skipped = select_ids(source, cfg.limit, done)
    wanted = len(todo) + skipped
    run_id = time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    say(f"job {cfg.job_id} (config {cfg.config_hash()}, run {run_id}): {len(source.ids)} prompt(s) in {source.uri}, "
        f"{wanted} selected, {skipped} already done, output {output.uri}")
    if cfg.resume and output.exists("job.json"):
        earlier = json.loads(output.get_text("job.json")).get("config_hash")
        if earlier and earlier != cfg.config_hash():
            say(f"WARNING: resuming a job made with config {earlier}; new rows get config {cfg.config_hash()}")
    output.put_text("job.json", cfg.to_json(), "application/json")

    plan: Optional[ActorPlan] = None
    t_exec = time.perf_counter()
    if todo:
        started = _init_ray(cfg, say)
        try:
            t_exec = time.perf_counter()
            plan = _execute(cfg, source, todo, output, run_id, say)
        finally:
            if started:
                import ray

                ray.shutdown()
    exec_s = time.perf_counter() - t_exec if todo else 0.0

    run_rows = read_telemetry(output, name_prefix=run_id) if todo else None
    run_rows = run_rows if run_rows is not None else empty_table()
    summary = summarize(run_rows, wall_time_s=exec_s, skipped=skipped, total_input=wanted)
    summary["job_wall_time_s"] = time.perf_counter() - t_job
    cols = ["prompt_id", "status", "finished_at"]
    all_rows = read_telemetry(output, columns=cols)
    statuses = latest_per_prompt(all_rows)["status"].to_pylist() if all_rows is not None else []
    summary.update(
        job_id=cfg.job_id, run_id=run_id, config_hash=cfg.config_hash(), input=source.uri, output=output.uri,
        device=plan.device if plan else None, num_actors=plan.num_actors if plan else 0,
        job_ok=statuses.count("ok"), job_failed=statuses.count("failed"),
    )
    summary_uri = output.put_text("summary.json", json.dumps(summary, indent=2, default=str) + "\n", "application/json")
    where = {
        "images": output.uri_for("images"),
        "telemetry": output.uri_for(TELEMETRY_DIR),
        "summary": summary_uri,
        "config": output.uri_for("job.json"),
    }
    print(format_summary(summary, title=f"job {cfg.job_id}", where=where), file=stream, flush=True)
    failed = summary["failed"]
    code = EXIT_ROWS_FAILED if failed and not cfg.allow_failures else EXIT_OK
    if failed and not cfg.allow_failures:
        say(f"{failed} row(s) failed: exit code {code} (pass --allow-failures to exit 0)")
    return JobResult(summary=summary, exit_code=code, output_uri=output.uri)


def main_guarded(cfg: JobConfig, stream: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """run_job with refusals turned into a message and an exit code."""
    try:
        return run_job(cfg, stream).exit_code
    except (JobRefused, ConfigError) as e:
        print(f"error: {e}", file=err, flush=True)
        return getattr(e, "exit_code", EXIT_BAD_INPUT)
