"""The engine as a Ray Data processor: a Dataset of prompts in, a Dataset of images out.

    import ray
    from pipeline.processor import build_processor

    processor = build_processor({"bundle": "emoji16", "num_actors": 2, "decode": {"method": "adt"}})
    ds = ray.data.read_parquet("prompts.parquet")   # columns prompt, seed (optional: prompt_id)
    ds = processor(ds)                              # one row per prompt: image, tokens, telemetry
    ds.write_parquet("out/")                        # or write_webdataset, or chain more stages

`build_processor(config)` takes a JobConfig (or its dict / YAML form: the same fields as
`jobs.generate`) and returns `processor(ds) -> ds`: a `map_batches` stage over a pool of
generator actors (`num_actors`, `gpus_per_actor` / `cpus_per_actor` placed by
pipeline.cluster.plan_actors, `batch_size` prompts per call, `decode.*` for the engine). Each
actor runs `GeneratorWorker` with `store_images=False`: the PNG travels as a column instead of
being written to the output. The rows (`OUTPUT_SCHEMA`):

- `image`: `{"bytes": PNG, "path": "<safe id>.png"}`, the struct Hugging Face `datasets` uses
  for its `Image` feature (the schema's "huggingface" metadata says so, so a Parquet written
  by `ds.write_parquet` loads with decoded images); null when the row failed;
- every telemetry column of pipeline.telemetry.SCHEMA except `image_key`: `prompt_id`,
  `prompt`, `seed`, `status` ("ok" | "failed") and `error` (per-row failures are data, as
  in jobs.generate), the token grid (`tokens`, `grid_h`, `grid_w`), acceptance, timing and the
  speedup columns.

Prompts without a `prompt_id` get one from the prompt and seed (`p-<sha256 prefix>`), so a
missing seed is derived the same way on every run. Other input columns are not carried
through. Ray Data's own context (progress bars, logs) is left as the user set it. `output` names where the actors share the engine's cost table (`costs/...`, the
only thing written there); left out, it is `<tmp>/adt-processor/<config hash>` on each node.

jobs.generate is this stage plus what a batch job needs around it: a ledger of durable
telemetry parts (resume skips finished ids), one writer per output (the lease), images written
to the output layout before their rows, a summary and exit codes (docs/pipeline.md, "The
engine as a Ray Data processor").
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pyarrow as pa

from pipeline.cluster import plan_actors
from pipeline.config import JobConfig, build_config
from pipeline.shards import IMAGE_STRUCT, sample_key
from pipeline.telemetry import SCHEMA, STATUS_OK
from pipeline.worker import GeneratorWorker, unpack

_HF_FEATURES = {"info": {"features": {"image": {"_type": "Image"}}}}  # the other columns: datasets infers them
OUTPUT_SCHEMA = pa.schema(
    [pa.field("image", IMAGE_STRUCT, metadata={"doc": "the PNG as {bytes, path} (datasets.Image); null when failed"})]
    + [f for f in SCHEMA if f.name != "image_key"],
    metadata={"huggingface": json.dumps(_HF_FEATURES)},
)


def build_processor(config: JobConfig | dict[str, Any] | None = None) -> Callable[[Any], Any]:
    """A function `ray.data.Dataset of prompts -> ray.data.Dataset of images` (see the
    module docstring); the config is validated here, so a bad field fails at once."""
    data = config.model_dump(mode="json") if isinstance(config, JobConfig) else dict(config or {})
    if not data.get("output"):
        data["output"] = None
    cfg = build_config(data)
    if data["output"] is None:
        cfg = cfg.model_copy(update={"output": str(Path(tempfile.gettempdir()) / "adt-processor" / cfg.config_hash())})
    cfg = cfg.model_copy(update={"output_format": "files"})  # images as columns: no shards either

    def process(ds: Any) -> Any:
        import ray
        from ray.data import ActorPoolStrategy

        if not ray.is_initialized():
            ray.init()
        plan = plan_actors(cfg, ray.cluster_resources())
        return ds.map_batches(
            ImageStage,
            fn_constructor_kwargs={"config": cfg.model_dump(mode="json"), "device": plan.device,
                                   "num_threads": plan.threads},
            batch_size=cfg.rows_per_call(),
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=plan.num_actors),
            num_gpus=plan.num_gpus or None,
            num_cpus=plan.num_cpus,
        )

    return process


class ImageStage:
    """Ray Data callable class: one GeneratorWorker per actor, images as columns."""

    def __init__(self, config: dict[str, Any], device: Optional[str] = None, num_threads: Optional[int] = None):
        self.worker = GeneratorWorker(config, device=device, num_threads=num_threads, store_images=False)

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        for chunk in self.worker(with_prompt_ids(batch)):
            yield image_rows(unpack(chunk), self.worker)


def prompt_id_of(prompt: Optional[str], seed: Optional[int]) -> str:
    """The id of a prompt row that has none: stable for the same prompt and seed."""
    digest = hashlib.sha256(f"{seed}\x00{prompt}".encode("utf-8", "surrogatepass")).hexdigest()
    return "p-" + digest[:16]


def with_prompt_ids(batch: pa.Table) -> pa.Table:
    """The batch with a prompt_id column (made from prompt + seed where absent or null)."""
    if "prompt_id" in batch.column_names and batch["prompt_id"].null_count == 0:
        return batch
    prompts = batch["prompt"].to_pylist()
    seeds = batch["seed"].to_pylist() if "seed" in batch.column_names else [None] * len(prompts)
    given = batch["prompt_id"].to_pylist() if "prompt_id" in batch.column_names else [None] * len(prompts)
    ids = pa.array([g if g is not None else prompt_id_of(p, s) for g, p, s in zip(given, prompts, seeds)], pa.string())
    if "prompt_id" in batch.column_names:
        return batch.set_column(batch.schema.get_field_index("prompt_id"), "prompt_id", ids)
    return batch.append_column("prompt_id", ids)


def image_rows(rows: pa.Table, worker: GeneratorWorker) -> pa.Table:
    """Telemetry rows -> output rows: the kept PNG of each ok row as the `image` column."""
    ids, status = rows["prompt_id"].to_pylist(), rows["status"].to_pylist()
    ok = [pid for pid, st in zip(ids, status) if st == STATUS_OK]
    pngs = iter(worker.take_pngs(ok))
    images = []
    for pid, st in zip(ids, status):
        png = next(pngs) if st == STATUS_OK else None
        images.append(None if png is None else {"bytes": png, "path": f"{sample_key(pid)}.png"})
    out = rows.drop_columns(["image_key"])
    return out.add_column(0, "image", pa.array(images, IMAGE_STRUCT)).cast(OUTPUT_SCHEMA)
