"""Throughput study: a grid over method x engine batch size x actors (x bundle x dtype), each
cell a real pipeline run (pipeline.driver.run_job) on the same prompts.

    python -m jobs.study --output outputs/study --methods ar,eagle2,adt --batches 1,4,16 --actors 1,2 --images 16
    ray job submit --working-dir . -- python -m jobs.study --output s3://bucket/studies/s1 --actors 1,2,4,8

Every cell decodes the first N prompts of one prompt list (<output>/prompts.parquet, the
input cycled with new ids when a cell needs more rows) with `decode.batch_size` = batch and
`num_actors` = actors: `warmup` images per actor (default: the batch size, one engine fill;
bundle load and cost calibration land there too), then `--images` measured images split
over the actors. The numbers (jobs.study_table): steady images/s in total, per actor and
per device, engine ms per image p50/p90, mean latency (Little's law), acceptance, speedup
vs `ar` at the same cell, scaling efficiency across actor counts.

Output (under --output, a path or s3:// prefix):

    prompts.parquet             the prompt list every cell reads
    cells/<cell>/...            that cell's whole job output (images, telemetry, job.json, ...)
    cells/<cell>/cell.json      written last: the cell is finished (a rerun skips it)
    study.parquet, study.md     one row per finished cell (rewritten after every cell)
    study_batch.png, study_scaling.png

A rerun with the same --output resumes: finished cells are skipped, a cell cut off midway is
cleared and run again. Locally Ray runs in this process (one Ray for the whole grid); under
`ray job submit` (RAY_ADDRESS set) or with --ray-address the cells run on that cluster.
Flags: one per StudyConfig field (`_` or `-`, no abbreviations); a bad one exits 2.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any, ClassVar, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from jobs.report_charts import MissingDependency, require_matplotlib
from jobs.study_table import CELL_COLUMNS, CellResult, CellSpec, charts, markdown, measure_cell, results_table, to_parquet_bytes
from pipeline.cli import CliParser, add_config_flags, config_overrides
from pipeline.config import DEFAULT_INPUT, ConfigError, StorageSettings, build_config, build_model, read_config_file
from pipeline.ledger import read_telemetry
from pipeline.storage import Storage, open_storage

log = logging.getLogger("jobs.study")
METHOD_DECODE: dict[str, dict[str, Any]] = {"ar": {}, "static": {}, "eagle2": {}, "adt": {}}  # job defaults per method


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


class StudyConfig(BaseModel):
    """jobs.study's options (one flag per field: pipeline/cli.py)."""

    model_config = ConfigDict(extra="forbid")
    cli_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the grid": ("bundles", "dtypes", "methods", "batches", "actors"),
        "each cell": ("images", "warmup", "temperature", "config"),
        "cluster": ("ray_address", "local_cpus"),
    }

    output: str = Field("outputs/study", description="Study prefix (path or s3://).")
    input: str = Field(DEFAULT_INPUT, description="Prompt Parquet (file, folder, s3://).")
    bundles: str = Field("emoji16", description="Comma list of bundles (NAME@N: NAME deepened to N layers by null "
                         "layers, e.g. emoji16@32, a 32-layer stand-in with the same images).")
    dtypes: str = Field("float32", description="Comma list of decode.dtype values.")
    methods: str = Field("ar,eagle2,adt", description="Comma list of methods.")
    batches: str = Field("1,4,16", description="Comma list of decode.batch_size values.")
    actors: str = Field("1,2", description="Comma list of actor counts.")
    images: int = Field(16, ge=1, description="Measured images per cell, after warm-up.")
    warmup: Optional[int] = Field(None, ge=0, description="Warm-up images per actor; none = the batch size.")
    temperature: Optional[float] = Field(None, ge=0, description="decode.temperature; none = the bundle's default.")
    config: Optional[str] = Field(None, description="Base JobConfig (YAML/JSON) for every cell: device, storage, tree, ...")
    ray_address: Optional[str] = Field(None, description="Ray cluster; none = RAY_ADDRESS if set, else a local Ray here.")
    local_cpus: Optional[float] = Field(None, gt=0, description="Logical CPUs of the local Ray; none = the cores this "
                                        "process may use + 1 (the spare the driver keeps for read/write tasks), so the "
                                        "actors together hold exactly those cores.")


def build_parser() -> CliParser:
    p = CliParser("python -m jobs.study", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    add_config_flags(p, StudyConfig)
    return p


def parse_args(argv: Optional[list[str]] = None) -> StudyConfig:
    """The options (exit 2 with a usage line and one error line on a bad flag or value)."""
    p = build_parser()
    try:
        return build_model(StudyConfig, config_overrides(vars(p.parse_args(argv)), StudyConfig), what="options")
    except ConfigError as e:
        p.error(" ".join(line.strip() for line in str(e).splitlines()))


def grid(args: StudyConfig) -> list[CellSpec]:
    return [CellSpec(b, d, m, bt, a) for b in _words(args.bundles) for d in _words(args.dtypes) for a in _ints(args.actors)
            for bt in _ints(args.batches) for m in _words(args.methods)]


def cell_counts(spec: CellSpec, images: int, warmup: Optional[int]) -> tuple[int, int, int]:
    """(warm-up per actor, prompts the cell decodes, prompts per worker call)."""
    w = spec.batch if warmup is None else warmup
    per_actor = w + math.ceil(images / spec.actors)
    return w, per_actor * spec.actors, max(spec.batch, math.ceil(per_actor / 2))


def write_prompts(store: Storage, src_uri: str, settings: StorageSettings, needed: int) -> str:
    """<prefix>/prompts.parquet with at least `needed` rows: the input, cycled with new ids."""
    key = "prompts.parquet"
    if store.exists(key) and pq.read_metadata(store.arrow_path(key), filesystem=store.arrow_fs()).num_rows >= needed:
        return store.uri_for(key)
    from pipeline.prompts import open_prompts

    source = open_prompts(src_uri, settings)
    base = pa.concat_tables([pq.read_table(p, filesystem=source.filesystem, columns=["prompt_id", "prompt"])
                             for p in source.paths])
    ids, texts = base["prompt_id"].to_pylist(), base["prompt"].to_pylist()
    rows = [{"prompt_id": ids[i % len(ids)] + (f".r{i // len(ids)}" if i >= len(ids) else ""), "prompt": texts[i % len(ids)]}
            for i in range(max(needed, len(ids)))]
    store.write_parquet(key, pa.Table.from_pylist(rows))
    return store.uri_for(key)


def _cell_config(base: dict[str, Any], spec: CellSpec, args: StudyConfig, prompts_uri: str, out_uri: str,
                 limit: int, rows: int):
    data = json.loads(json.dumps(base))
    data.pop("config_hash", None)
    decode = dict(data.get("decode") or {})
    decode.update(METHOD_DECODE.get(spec.method, {}), method=spec.method, dtype=spec.dtype, batch_size=spec.batch)
    if args.temperature is not None:
        decode["temperature"] = args.temperature
    data.update(job_id=spec.name, input=prompts_uri, output=out_uri, bundle=spec.bundle, num_actors=spec.actors,
                batch_size=rows, limit=limit, decode=decode, resume=False, allow_failures=True, progress=False,
                baseline_fraction=0.0)
    return build_config(data)


def run_cell(store: Storage, spec: CellSpec, args: StudyConfig, base: dict[str, Any], prompts_uri: str) -> CellResult:
    import ray

    from pipeline.cluster import plan_actors
    from pipeline.driver import run_job

    prefix = f"cells/{spec.name}"
    stale = [k for k in store.list_keys(prefix) if k.startswith(prefix + "/")]
    for key in stale:  # a cell cut off midway: start it again from nothing
        store.delete(key)
    warm, limit, rows = cell_counts(spec, args.images, args.warmup)
    cfg = _cell_config(base, spec, args, prompts_uri, store.uri_for(prefix), limit, rows)
    plan = plan_actors(cfg, ray.cluster_resources(), num_prompts=limit)
    devices = plan.num_actors * (plan.num_gpus if plan.device == "cuda" else plan.num_cpus)
    log.info("cell %s: %d prompts (%d warm-up per actor), %d per call, %d %s actor(s)%s", spec.name, limit, warm, rows,
             plan.num_actors, plan.device, f" (cleared {len(stale)} stale objects)" if stale else "")
    t0 = time.perf_counter()
    res = run_job(cfg, stream=sys.stderr)
    wall = time.perf_counter() - t0
    cell_store = open_storage(store.uri_for(prefix), cfg.storage)
    table = read_telemetry(cell_store, columns=CELL_COLUMNS)
    if table is None:
        raise RuntimeError(f"cell {spec.name} wrote no telemetry (exit code {res.exit_code})")
    result = measure_cell(spec, table, warm, plan.device, devices, wall)
    store.put_text(f"{prefix}/cell.json", json.dumps(asdict(result), indent=2) + "\n", "application/json")
    return result


def write_outputs(store: Storage, results: list[CellResult]) -> pa.Table:
    table = results_table(results)
    store.put_bytes("study.parquet", to_parquet_bytes(table), "application/vnd.apache.parquet")
    store.put_text("study.md", markdown(table), "text/markdown")
    for name, data in charts(table).items():
        store.put_bytes(name, data, "image/png")
    return table


def _init_ray(args: StudyConfig) -> None:
    import ray

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ray.init(address="local", num_cpus=args.local_cpus or cores + 1, include_dashboard=False, object_store_memory=512 * 1024**2,
             log_to_driver=True, _system_config={"worker_niceness": 0})  # a benchmark: actors at normal priority


def run_study(args: StudyConfig) -> pa.Table:
    """Run (or resume) the grid; returns the study table."""
    require_matplotlib()  # fail before hours of cells, not after
    base = read_config_file(args.config) if args.config else {}
    settings = StorageSettings(**base.get("storage", {}))
    store = open_storage(args.output, settings)
    cells = grid(args)
    needed = max(cell_counts(c, args.images, args.warmup)[1] for c in cells)
    prompts_uri = write_prompts(store, args.input, settings, needed)
    results: dict[str, CellResult] = {}
    todo = []
    for spec in cells:
        key = f"cells/{spec.name}/cell.json"
        if store.exists(key):
            results[spec.name] = CellResult(**json.loads(store.get_text(key)))
        else:
            todo.append(spec)
    log.info("study %s: %d cells, %d finished, %d to run", store.uri, len(cells), len(results), len(todo))
    if todo:
        import ray

        started = not ray.is_initialized()
        if started:
            _init_ray(args)
        try:
            for i, spec in enumerate(todo, 1):
                log.info("[%d/%d] %s", i, len(todo), spec.name)
                results[spec.name] = run_cell(store, spec, args, base, prompts_uri)
                write_outputs(store, [results[c.name] for c in cells if c.name in results])
        finally:
            if started:
                ray.shutdown()
    table = write_outputs(store, [results[c.name] for c in cells if c.name in results])
    log.info("study table: %s", store.uri_for("study.md"))
    return table


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        table = run_study(args)
    except MissingDependency as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
