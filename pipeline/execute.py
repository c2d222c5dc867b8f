"""Running the actor pool: the Ray Data plan of one run, rows handed to the ledger as images
finish.

    read_parquet(prompts) -> keep the selected ids (keep_hashes) -> repartition so every actor
    gets work -> map_batches(GeneratorWorker, ActorPoolStrategy(min, max), GPUs or CPU shares
    per actor) -> iter_batches -> unpack -> RowSink (ledger + progress)
    -> prompts without a row (a batch Ray retried after its actor or node died) run again

All of it streams: the selected prompts are never materialized, the driver holds them as an
IdSet (pipeline.idset: 9 bytes a prompt) put once in the object store for the read's filter.

Every prompt gets exactly one row: the sink drops repeats, and after the pool ends the
prompts with no row are run again in a new pool (up to REDO_PASSES passes; what still has
none gets a failed row saying so, so the job cannot end 0 with prompts unrecorded). Why rows
go missing at all: when an actor dies mid-batch Ray retries its whole batch and, matching the
retry's chunks to the first attempt's by position, passes on only chunks past those already
delivered; chunks are cut by time as images finish, so positions do not match prompts.
A `PoolWatch` stops the job (exit 3) when no live node can host an actor for
node_lost_wait_s. However a pool ends (done, a store down, a signal), its teardown runs with
signals held and no actor of it is left alive after (pipeline.pool_actors), so a next job in
the same Ray session finds the resources free.

The generation stage runs under a 1-byte block-size target, so each chunk a worker yields is
handed on at once instead of being held until Ray Data's default 128 MiB block fills; the
prompt read and repartition keep the default target (pipeline.blocks: a per-operator
override, so the read is not split into one-row blocks and nothing has to be materialized).
The prompt files go through Ray Data's V1 Parquet reader (`_read_prompt_files`).
"""

from __future__ import annotations

import math
import os
import re
import signal
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, TextIO

import pyarrow as pa

from pipeline.checks import JobRefused
from pipeline.cluster import (ActorPlan, ClusterUnavailable, PoolWatch, actor_restarts, autoscaler_max_resources,
                              plan_actors, plan_gpu_demand, ray_target, wait_for_gpus)
from pipeline.config import JobConfig
from pipeline.ledger import Ledger
from pipeline.progress import Progress, quiet_ray_data
from pipeline.progress_sink import RowSink
from pipeline.blocks import stream_chunks
from pipeline.idset import IdSet, keep_hashes
from pipeline.pool_actors import PoolActors
from pipeline.prompts import PromptSource, ids_in
from pipeline.retry import StorageUnavailable, is_transient
from pipeline.storage import is_remote
from pipeline.telemetry import RowContext, failed_row, to_table
from pipeline.worker import GeneratorWorker, unpack

REDO_PASSES = 3  # pools run over the prompts still without a row, at most
PROMPT_TASK_CPUS = 0.25  # logical CPUs of a prompt read / filter task (I/O beside the actors)
# Test override: actors reserve logical GPUs (num_gpus) but their engines compute on CPU
# (a multi-node test cluster on a machine without GPUs; docs/deploy.md).
CPU_ENGINE_ENV = "ADT_ENGINE_ON_CPU"


class PoolLost(ClusterUnavailable):
    """Every node that could host an actor left mid-run and none joined in time (exit 3,
    after the rows done were written)."""


@dataclass
class PoolRun:
    """One run of the actor pool: its prompts, where its rows go and how it reports."""

    cfg: JobConfig
    source: PromptSource
    todo: IdSet  # the prompts to generate (the sink marks each one whose row came)
    ledger: Ledger
    say: Callable[[str], None]
    run_id: Optional[str] = None
    bar: Optional[TextIO] = None  # a terminal: progress drawn as a bar there, else plain lines
    worker: type = GeneratorWorker  # the actor class (tests pass a subclass that injects faults)
    stats: dict = field(default_factory=dict)  # filled by execute: passes, actor restarts, duplicates dropped
    interrupt: Callable[[], None] = lambda: None  # stops the main thread (raises JobInterrupted there)
    everything: bool = False  # todo is every input prompt: the read needs no filter
    # holds SIGTERM / SIGINT (and so `interrupt`) until the block ends: the pool's teardown
    # runs whole (the driver's _Signals.held)
    hold: Callable[[], ContextManager[None]] = nullcontext


class JobInterrupted(BaseException):
    """SIGTERM / SIGINT arrived (a BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


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


def memory_refusal(err: BaseException) -> Optional[JobRefused]:
    """An actor whose memory plan does not fit one image (adt_core.memory.MemoryPlanError, as
    Ray hands it back) -> the job's refusal in one line (exit 2): nothing was decoded."""
    from adt_core.memory import MemoryPlanError

    seen: set[int] = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryPlanError):
            return JobRefused(f"an actor's memory plan: {str(e).strip().splitlines()[-1]}")
        e = e.__cause__ or e.__context__
    found = re.search(r"MemoryPlanError: (.+)", str(err))
    return JobRefused(f"an actor's memory plan: {found.group(1).strip()}") if found else None


def execute(run: PoolRun) -> ActorPlan:
    """Run the actor pool over `run.todo`, handing every chunk of rows to the ledger."""
    import ray
    from ray.autoscaler.sdk import request_resources

    cfg = run.cfg
    address = ray_target(cfg)
    resources = ray.cluster_resources()
    demand = plan_gpu_demand(cfg, resources, len(run.todo), address, autoscaler_max_resources())
    try:
        if demand is not None:
            resources = wait_for_gpus(demand, run.say, ray.cluster_resources, request_resources)
        plan = plan_actors(cfg, resources, num_prompts=len(run.todo), can_grow=address != "local",
                           waited_s=demand.wait_s if demand else 0.0)
        _announce(run, plan)
        _pump(run, plan)
        return plan
    finally:
        if demand is not None:
            request_resources(bundles=[])  # the job's demand ends with it: the autoscaler may scale down


def _announce(run: PoolRun, plan: ActorPlan) -> None:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1 and not is_remote(run.cfg.output):
        run.say(f"WARNING: {len(nodes)} nodes but a local output path: images land on each worker's own disk")
    for note in plan.notes:
        run.say(note)
    run.say(f"{len(run.todo)} prompt(s) to generate on {plan.num_actors} {plan.device} actor(s) "
            f"({plan.num_gpus:g} GPU, {plan.num_cpus:g} CPU each), {run.cfg.rows_per_call()} prompts per call, "
            f"{run.cfg.decode.batch_size} in flight per actor; each actor loads the bundle first "
            f"(its 'worker ready' line says how long that took)")


def _dataset(run: PoolRun, plan: ActorPlan, todo: IdSet, everything: bool):
    """The Ray Data plan: the prompts `todo` (streamed) -> the generator actor pool."""
    from ray.data import ActorPoolStrategy, DataContext

    cfg, rows = run.cfg, run.cfg.rows_per_call()
    ctx = DataContext.get_current()
    quiet_ray_data(ctx, show=cfg.progress)
    if ctx.wait_for_min_actors_s < 0:
        ctx.wait_for_min_actors_s = 1800  # fail rather than hang when actors cannot be placed
    source = run.source
    ds = _read_prompt_files(source).select_columns(source.columns)
    # The filter: the hashes travel once, in the map's transformer (Ray Data puts it in the
    # object store); none when every prompt is selected. Ray Data fuses it with the repartition.
    # Read and filter ask PROMPT_TASK_CPUS each: they run beside the actors, and a read held back
    # by the pool's backpressure keeps its CPU, so with a whole CPU each the filter could never
    # be placed on a 2-CPU node whose actors hold the rest (10^7 prompts in one file hung so).
    ds = ds.map_batches(keep_hashes, fn_kwargs={"hashes": None if everything else todo.hashes, "salt": todo.salt},
                        batch_format="pyarrow", batch_size=None, num_cpus=PROMPT_TASK_CPUS)
    # Small prompt files arrive as one block (one actor would get everything): split by rows.
    per_block = max(1, min(rows, math.ceil(len(todo) / (plan.pool_max * 4))))
    device = "cpu" if os.environ.get(CPU_ENGINE_ENV) == "1" else plan.device
    prompts = ds.repartition(target_num_rows_per_block=per_block)  # read errors: see _pump
    stream_chunks(run.worker)
    ds = prompts.map_batches(
        run.worker,
        fn_constructor_kwargs={"config": cfg.model_dump(mode="json"), "device": device,
                               "num_threads": plan.threads, "run_id": run.run_id},
        batch_size=rows,
        batch_format="pyarrow",
        compute=(ActorPoolStrategy(min_size=plan.num_actors, max_size=plan.pool_max) if plan.pool_max > plan.num_actors
                 else ActorPoolStrategy(size=plan.num_actors)),
        num_gpus=plan.num_gpus or None,
        num_cpus=plan.num_cpus,
    )
    return ds


def _read_prompt_files(source: PromptSource):
    """The prompt files as a Ray Dataset, through Ray Data's V1 Parquet reader. The V2 reader
    (Ray 2.60's default) starts a pool of 32 footer-reading actors for every read, each a new
    worker process: ~5 s of every job's start-up on a small machine, for a one-file prompt
    list. V1 opens the files in the driver and samples at most 10 of them in Ray tasks (on the
    pooled task workers); both read the rows in Ray tasks. Only this read is switched: the
    process's DataContext is put back."""
    import ray
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
    try:
        return ray.data.read_parquet(source.paths, filesystem=source.filesystem, num_cpus=PROMPT_TASK_CPUS)
    finally:
        ctx.use_datasource_v2 = saved


def _pump(run: PoolRun, plan: ActorPlan) -> None:
    """Chunks of rows from the pool to the sink (ledger + progress) until every prompt has a
    row (passes over the missing ones); the progress heartbeat starts before the prompts are
    read."""
    progress = Progress(len(run.todo), run.say, run.cfg.progress_interval_s, bar=run.bar)
    sink = RowSink(run.ledger, progress, run.todo)
    watch = PoolWatch(plan, run.cfg.node_lost_wait_s, run.interrupt)
    todo, passes = run.todo, 0
    try:
        with watch, progress.foreign_output_below():
            while len(todo) and passes < REDO_PASSES:
                if passes:
                    run.say(f"{len(todo)} prompt(s) came back without a row (a batch retried after its actor or node "
                            f"was lost): running them again (pass {passes + 1} of {REDO_PASSES})")
                passes += 1
                _drain(run, plan, todo, run.everything and passes == 1, sink)
                todo = sink.missing()
        if len(todo):
            run.say(f"ERROR: {len(todo)} prompt(s) still have no row after {REDO_PASSES} passes: recorded as failed")
            sink.put(_unreturned(run, todo))
        sink.close()
    except JobInterrupted:
        if watch.lost:
            raise PoolLost(watch.lost) from None
        raise
    finally:
        try:
            with run.hold():
                sink.stop()  # what arrived is written (not cut short: the ledger is the main thread's next)
        finally:
            run.stats.update(passes=passes, duplicates_dropped=sink.duplicates,
                             actor_restarts=actor_restarts(run.ledger.actor_ids))


def _drain(run: PoolRun, plan: ActorPlan, todo: IdSet, everything: bool, sink: RowSink) -> None:
    """One pool over `todo`: every chunk it yields into the sink. However it ends, its actors
    are gone when this returns (pipeline.pool_actors: the next pool in this Ray gets their
    resources)."""
    batches = iter(())
    actors = PoolActors(run.worker, run.say)
    try:
        batches = iter(_dataset(run, plan, todo, everything).iter_batches(batch_size=None, batch_format="pyarrow"))
        for chunk in batches:
            sink.put(unpack(chunk))
    except (StorageUnavailable, JobInterrupted):
        raise
    except Exception as e:  # noqa: BLE001 - a failed execution: a store, or a bug
        outage = _dataset_failure(e, run.source)
        if outage is not None:
            raise outage from e
        refused = memory_refusal(e)
        if refused is not None:
            raise refused from None
        raise
    finally:
        with run.hold():  # an interrupt inside Ray Data's shutdown would leave the actors running
            try:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()  # stops the pool (Ray Data kills its actors) when we leave early
            finally:
                actors.end()  # any actor the teardown left alive


def _unreturned(run: PoolRun, todo: IdSet) -> pa.Table:
    """Failed rows for prompts the pool never returned a row for."""
    cfg = run.cfg
    ctx = RowContext(job_id=cfg.job_id, bundle=cfg.bundle, method=cfg.decode.method, config_hash=cfg.config_hash(),
                     run_id=run.run_id, actor_id="driver", node_id="driver")
    why = f"no row came back from the actor pool in {REDO_PASSES} passes (actors or nodes lost)"
    return to_table([failed_row(ctx, pid, None, why) for pid in ids_in(run.source, todo)])
