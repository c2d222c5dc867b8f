"""Running the actor pool: the Ray Data plan of one run, each returned batch of rows handed
to the ledger before the next is taken.

    read_parquet(prompts) -> keep the selected ids -> repartition so every actor gets work
    -> map_batches(GeneratorWorker, ActorPoolStrategy(min, max), GPUs or CPU shares per
    actor) -> iter_batches -> Ledger.add
"""

from __future__ import annotations

import math
import os
import signal
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.cluster import ActorPlan, autoscaler_max_resources, plan_actors, plan_gpu_demand, ray_target, wait_for_gpus
from pipeline.config import JobConfig
from pipeline.ledger import Ledger
from pipeline.progress import Progress
from pipeline.prompts import PromptSource
from pipeline.retry import StorageUnavailable, is_transient
from pipeline.storage import is_remote
from pipeline.worker import FAULT_ENV, GeneratorWorker


class JobInterrupted(BaseException):
    """SIGTERM / SIGINT arrived (a BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _keep_ids(batch: pa.Table, ids: pa.Array) -> pa.Table:
    return batch.filter(pc.is_in(batch["prompt_id"], value_set=ids))


def _dataset_failure(err: BaseException, source: PromptSource) -> Optional[StorageUnavailable]:
    """The StorageUnavailable behind a failed Ray Data execution, if a store caused it."""
    seen: set[int] = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, StorageUnavailable):
            return e
        if is_transient(e) or "storage unavailable" in str(e):
            return StorageUnavailable(source.uri, f"reading prompts failed: {str(e).strip().splitlines()[-1][:300]}")
        e = e.__cause__ or e.__context__
    text = str(err)
    if any(t in text for t in ("NETWORK_CONNECTION", "curlCode", "Connection refused")):
        return StorageUnavailable(source.uri, f"reading prompts failed: {text.strip().splitlines()[-1][:300]}")
    return None


def execute(cfg: JobConfig, source: PromptSource, todo: list[str], ledger: Ledger, say: Callable[[str], None],
            run_id: Optional[str] = None) -> ActorPlan:
    """Run the actor pool over `todo`, handing every returned batch of rows to the ledger."""
    import ray
    from ray.autoscaler.sdk import request_resources

    address = ray_target(cfg)
    resources = ray.cluster_resources()
    demand = plan_gpu_demand(cfg, resources, len(todo), address, autoscaler_max_resources())
    try:
        if demand is not None:
            resources = wait_for_gpus(demand, say, ray.cluster_resources, request_resources)
        return _run_pool(cfg, source, todo, ledger, say, run_id, resources, address,
                         demand.wait_s if demand else 0.0)
    finally:
        if demand is not None:
            request_resources(bundles=[])  # the job's demand ends with it: the autoscaler may scale down


def _run_pool(cfg: JobConfig, source: PromptSource, todo: list[str], ledger: Ledger, say: Callable[[str], None],
              run_id: Optional[str], resources: dict[str, float], address: str, waited_s: float) -> ActorPlan:
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    plan = plan_actors(cfg, resources, num_prompts=len(todo), can_grow=address != "local", waited_s=waited_s)
    rows = cfg.rows_per_call()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1 and not is_remote(cfg.output):
        say(f"WARNING: {len(nodes)} nodes but a local output path: images land on each worker's own disk")
    for note in plan.notes:
        say(note)
    say(f"{len(todo)} prompt(s) to generate on {plan.num_actors} {plan.device} actor(s) "
        f"({plan.num_gpus:g} GPU, {plan.num_cpus:g} CPU each), {rows} prompts per call, "
        f"{cfg.decode.batch_size} in flight per actor")

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = cfg.progress
    if ctx.wait_for_min_actors_s < 0:
        ctx.wait_for_min_actors_s = 1800  # fail rather than hang when actors cannot be placed

    ds = ray.data.read_parquet(source.paths, filesystem=source.filesystem).select_columns(source.columns)
    if len(todo) < len(source.ids):
        ds = ds.map_batches(_keep_ids, fn_kwargs={"ids": pa.array(todo, pa.string())}, batch_format="pyarrow")
    # Small prompt files arrive as one block (one actor would get everything): split by rows.
    per_block = max(1, min(rows, math.ceil(len(todo) / (plan.pool_max * 4))))
    ds = ds.repartition(target_num_rows_per_block=per_block)
    ds = ds.map_batches(
        GeneratorWorker,
        fn_constructor_kwargs={
            "config": cfg.model_dump(mode="json"),
            "device": plan.device,
            "fault": os.environ.get(FAULT_ENV),
            "num_threads": plan.threads,
            "run_id": run_id,
        },
        batch_size=rows,
        batch_format="pyarrow",
        compute=(ActorPoolStrategy(min_size=plan.num_actors, max_size=plan.pool_max) if plan.pool_max > plan.num_actors
                 else ActorPoolStrategy(size=plan.num_actors)),
        num_gpus=plan.num_gpus or None,
        num_cpus=plan.num_cpus,
    )
    batches = iter(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    try:
        progress = Progress(len(todo), say, cfg.progress_interval_s)
        for batch in batches:
            ledger.add(batch)  # durable before the next batch is taken
            progress.add(batch.num_rows, pc.sum(pc.equal(batch["status"], "ok")).as_py() or 0)
    except (StorageUnavailable, JobInterrupted):
        raise
    except Exception as e:  # noqa: BLE001 - a failed execution: a store, or a bug
        outage = _dataset_failure(e, source)
        if outage is not None:
            raise outage from e
        raise
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # stops the pool when we leave early
    return plan
