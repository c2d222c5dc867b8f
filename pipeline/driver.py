"""The job driver: prompts (Parquet) -> Ray Data actor pool of GeneratorWorkers -> ledger.

    read_parquet(prompts) -> keep the selected ids (limit, resume) -> repartition so every
    actor gets work -> map_batches(GeneratorWorker, ActorPoolStrategy(size=N), GPUs or
    fractional CPUs per actor) -> rows come back as images finish; the driver writes them
    durably (pipeline.ledger) and shows the progress (pipeline.execute), then compacts them

then `summary.json` and a one-screen summary (pipeline.summary). A run is a
sequence of small steps sharing one `_Run`: _select (history, resume, the prompts to do) ->
_generate (Ray and the pool) -> _finish_outputs -> _summarize -> _report. Everything that can be refused is refused
before Ray starts: the config (the engine's DecodeConfig and sampling included), the prompt
input (every page of every column read), the output's lease, a resume with another config.

Output layout (rooted at JobConfig.output, a path or s3:// prefix):

    lease.json               held while a job writes here (pipeline.lease)
    job.json                 the JobConfig of the first run, with its config_hash
    memory_plan.json         the latest run's memory plan: images in flight per actor, and why
    runs/<run id>.json       one record per run: its config, hash, end, counts (pipeline.history)
    images/<id>.png          one image per ok prompt (id sanitised by storage.safe_name)
    telemetry/*.parquet      one row per processed prompt (pipeline.telemetry.SCHEMA)
    summary.json             counts, throughput, speedups of the latest run

Exit codes: pipeline.exit_codes (EXIT_CODES; docs/pipeline.md); main_guarded turns every way
a job can end into one of them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.checks import JobRefused, check_bundle, check_engine_config, plan_job_memory
from pipeline.cluster import ActorPlan, ClusterUnavailable, connect
from pipeline.execute import JobInterrupted, PoolLost, PoolRun, execute
from pipeline.exit_codes import (EXIT_BAD_INPUT, EXIT_CODES, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NO_RESOURCES,
                                 EXIT_OK, EXIT_OUTPUT_BUSY, EXIT_ROWS_FAILED, EXIT_STORAGE_UNAVAILABLE, RUN_STATUS,
                                 run_exit_code)
from pipeline.config import DEFAULT_INPUT, ConfigError, JobConfig, packaged_input
from pipeline.history import ConfigChanged, check_and_record, finish_record
from pipeline.lease import Lease, LeaseHeld
from pipeline.ledger import EarlierRuns, Ledger, compact, earlier_runs, outputs_telemetry, release_arrow_memory
from pipeline.progress import is_terminal, quiet_progress_bars
from pipeline.idset import IdSet, id_hashes
from pipeline.prompts import PromptInputError, PromptSource, open_prompts, select
from pipeline.shards import finish_outputs
from pipeline.retry import StorageUnavailable
from pipeline.storage import Storage, is_remote, open_storage, parse_uri
from pipeline.summary import format_summary, report_args
from pipeline.telemetry import STATUS_OK, TELEMETRY_DIR
from pipeline.worker import GeneratorWorker

log = logging.getLogger(__name__)

MEMORY_PLAN = "memory_plan.json"  # the start-up memory plan of the latest run (adt_core.memory)



@dataclass
class JobResult:
    summary: dict[str, Any]
    exit_code: int
    output_uri: str


def _absolute(cfg: JobConfig) -> JobConfig:
    """Local paths become absolute, so actors (another cwd) and job.json agree. The default
    input, when this checkout's examples/ is not here (an installed wheel), is the copy
    packaged with the pipeline."""
    upd = {}
    if cfg.input == DEFAULT_INPUT and not os.path.exists(DEFAULT_INPUT):
        upd["input"] = str(packaged_input())
    for name in ("input", "output"):
        value = upd.get(name, getattr(cfg, name))
        if not is_remote(value):
            upd[name] = parse_uri(value).path
    return cfg.model_copy(update=upd)


class _Printer:
    def __init__(self, stream: TextIO):
        self.stream = stream
        self.terminal = is_terminal(stream)

    def __call__(self, msg: str) -> None:
        clear = "\r\x1b[K" if self.terminal else ""  # over a progress bar being drawn
        print(f"{clear}[generate] {msg}", file=self.stream, flush=True)


class _Signals:
    """SIGTERM / SIGINT raise JobInterrupted in the main thread (once; a second signal acts
    as it normally would). Outside the main thread nothing is installed."""

    def __init__(self):
        self.previous: dict[int, Any] = {}
        self.active = threading.current_thread() is threading.main_thread()
        self.holding = False
        self.pending: Optional[int] = None  # a signal that arrived while held

    def _handle(self, signum, frame):
        self.restore()
        if self.holding:
            self.pending = signum
            return
        raise JobInterrupted(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        """A signal (or `interrupt`) inside the block raises JobInterrupted when it ends, not in
        its middle (the pool's teardown: cut short in Ray Data's shutdown, it left actors alive)."""
        if self.holding:
            yield
            return
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        signum, self.pending = self.pending, None
        if signum is not None:
            raise JobInterrupted(signum)

    def install(self) -> None:
        if self.active:
            for sig in (signal.SIGTERM, signal.SIGINT):
                prev = signal.signal(sig, self._handle)
                self.previous.setdefault(sig, prev)

    def interrupt(self) -> None:
        """From another thread: raise JobInterrupted in the main thread, even while it waits in a
        lock (a real SIGINT to that thread wakes it; _thread.interrupt_main only sets a flag that a
        blocked Queue.get never reads). Nothing when the job runs outside the main thread."""
        if self.active and self.previous:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev)
        self.previous = {}


def run_job(cfg: JobConfig, stream: Optional[TextIO] = None, worker: type = GeneratorWorker) -> JobResult:
    """Run one generation job end to end; raises JobRefused / StorageUnavailable /
    ClusterUnavailable / LeaseHeld / JobInterrupted when nothing could be done, else
    returns the summary and the exit code (EXIT_CODES). `worker` is the actor class (tests
    pass a subclass that injects faults)."""
    signals = _Signals()
    signals.install()
    try:
        return _run(cfg, sys.stdout if stream is None else stream, signals, worker)
    finally:
        signals.restore()


@dataclass
class _Run:
    """One run of a job, from its lease to its summary: what the steps below share."""

    cfg: JobConfig
    stream: TextIO
    say: _Printer
    signals: _Signals
    output: Storage
    source: PromptSource
    run_id: str
    lease: Lease
    worker: type
    t_job: float  # perf_counter at the start of the job
    resumed: bool = False  # the output already held telemetry
    earlier: Optional[EarlierRuns] = None  # what earlier runs did (counts), on resume
    todo: IdSet = field(default_factory=lambda: IdSet(np.zeros(0, np.uint64), 0))  # prompts this run generates
    everything: bool = False  # todo is every input prompt
    skipped: int = 0  # selected ids already done
    ledger: Optional[Ledger] = None
    plan: Optional[ActorPlan] = None
    stopped: Optional[BaseException] = None  # why the run ended early
    exec_s: float = 0.0  # the pool's wall time (Ray start-up excluded)
    pool: dict = field(default_factory=dict)  # the pool's passes, actor restarts, duplicate rows dropped

    @property
    def wanted(self) -> int:
        return len(self.todo) + self.skipped


def _run(cfg: JobConfig, stream: TextIO, signals: _Signals, worker: type) -> JobResult:
    t_job = time.perf_counter()
    quiet_progress_bars(show=cfg.progress)
    cfg = _absolute(cfg)
    check_engine_config(cfg)
    memory, device_source = plan_job_memory(cfg, check_bundle(cfg))  # before Ray: a plan without one image is refused
    if memory is not None and memory.images < cfg.decode.batch_size:  # memory caps the engine batch
        cfg = cfg.model_copy(update={"decode": cfg.decode.model_copy(update={"batch_size": memory.images})})
    try:
        output = open_storage(cfg.output, cfg.storage)
        source = open_prompts(cfg.input, cfg.storage)
    except (PromptInputError, ValueError) as e:
        raise JobRefused(str(e)) from None
    existing = output.list_keys(TELEMETRY_DIR)
    if existing and not cfg.resume:
        raise JobRefused(f"{output.uri_for(TELEMETRY_DIR)} already holds telemetry from an earlier run: "
                         f"pass --resume to continue that job, or choose another --output")
    run_id = time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    lease = Lease(output, f"{cfg.job_id}/{run_id}", cfg.lease_ttl_s)
    try:
        lease.acquire(wait_s=cfg.lease_wait_s)
    except LeaseHeld as e:
        raise JobRefused(str(e), EXIT_OUTPUT_BUSY) from None
    run = _Run(cfg, stream, _Printer(stream), signals, output, source, run_id, lease, worker, t_job, bool(existing))
    try:
        _memory_plan(run, memory, device_source)
        _select(run)
        _generate(run)
        _finish_outputs(run)
        return _report(run, *_summarize(run))
    finally:
        lease.release()


def _memory_plan(run: _Run, plan: Any, device_source: str) -> None:
    """The memory plan in one line, and memory_plan.json beside job.json (each actor plans
    again on its own device and keeps at most that many images in flight)."""
    if plan is None:
        run.say("memory plan: made by each actor on its own device (give --device-memory-gb to plan here)")
        return
    run.say(f"{plan.line()} (device size from {device_source})")
    doc = {"run_id": run.run_id, "bundle": run.cfg.bundle, "method": run.cfg.decode.method,
           "device_size_from": device_source, **plan.to_dict()}
    run.output.put_text(MEMORY_PLAN, json.dumps(doc, indent=2) + "\n", "application/json")


def _select(run: _Run) -> None:
    """Check the run against the job's history and choose its prompts (resume skips the done)."""
    cfg, output = run.cfg, run.output
    if run.resumed:
        merged = compact(output, cfg.telemetry_rows_per_file)  # parts left by a run that was killed
        if merged:
            run.say(f"compacted {merged} telemetry part(s) left by an earlier run")
    try:
        earlier_hash = check_and_record(output, cfg, run.run_id)
    except ConfigChanged as e:
        raise JobRefused(str(e)) from None
    if earlier_hash:
        run.say(f"WARNING: resuming a job made with config {earlier_hash}; new rows get config {cfg.config_hash()}")
    run.earlier, ids = earlier_runs(output, cfg.resume)
    sel = select(run.source, cfg.limit, ids[0] if ids else None)
    run.todo, run.skipped, run.everything = sel.todo, sel.skipped, sel.everything
    if ids is not None and len(ids[1]):  # failed before: which of them this run retries
        failed = ids[1].filter(pc.is_in(ids[1], value_set=run.source.ids))
        pos = run.todo.positions(id_hashes(failed, run.todo.salt))
        run.earlier.retried = np.zeros(len(run.todo), dtype=bool)
        run.earlier.retried[pos[pos >= 0]] = True
    del ids
    run.source.release()  # the selection is made: no per-prompt array of the input stays in the driver
    release_arrow_memory()
    run.ledger = Ledger(output, run.run_id, cfg.ledger_flush_rows)
    run.say(f"job {cfg.job_id} (config {cfg.config_hash()}, run {run.run_id}): {run.source.count} prompt(s) in "
            f"{run.source.uri}, {run.wanted} selected, {run.skipped} already done, output {output.uri}")


def _generate(run: _Run) -> None:
    """Start or join Ray and run the pool; an interruption or a store outage ends it early."""
    if not run.todo:
        return
    started = False
    t_exec = time.perf_counter()
    try:
        started = connect(run.cfg, run.say)
        run.signals.install()  # ray.init in the main thread installs its own SIGTERM handler
        run.lease.on_lost = run.signals.interrupt
        t_exec = time.perf_counter()
        bar = run.stream if run.say.terminal else None
        pool = PoolRun(run.cfg, run.source, run.todo, run.ledger, run.say, run.run_id, bar, run.worker, run.pool,
                       run.signals.interrupt, run.everything, hold=run.signals.held)
        run.plan = execute(pool)
    except (JobInterrupted, StorageUnavailable, PoolLost) as e:
        run.stopped = e
    finally:
        run.lease.on_lost = None
        if started:
            import ray

            ray.shutdown()
        run.exec_s = time.perf_counter() - t_exec
    if isinstance(run.stopped, JobInterrupted) and run.lease.lost:
        run.stopped = StorageUnavailable(run.output.uri, f"the output lease could not be renewed: {run.lease.lost}")
    if isinstance(run.stopped, JobInterrupted):
        run.say(f"{run.stopped}: finishing what was done")


def _finish_outputs(run: _Run) -> None:
    """The last rows durable, telemetry parts compacted, shards reconciled."""
    cfg, output = run.cfg, run.output
    try:
        run.ledger.flush()
        compact(output, cfg.telemetry_rows_per_file)
        release_arrow_memory()
        if not isinstance(run.stopped, StorageUnavailable):
            done = finish_outputs(output, cfg.output_format, outputs_telemetry(output, cfg.output_format))
            if done.get("rewritten") or done.get("deleted"):
                run.say(f"shards: {done['rewritten']} rewritten, {done['deleted']} deleted (images of rows that "
                        f"were not durable, now in another shard)")
    except StorageUnavailable as e:
        run.stopped = run.stopped if isinstance(run.stopped, StorageUnavailable) else e


def _summarize(run: _Run) -> tuple[dict[str, Any], int]:
    """This run's summary (summary.json) and the job's exit code."""
    cfg = run.cfg
    summary = run.ledger.summary(wall_time_s=run.exec_s, skipped=run.skipped, total_input=run.wanted,
                                 in_flight=cfg.decode.batch_size)
    summary["job_wall_time_s"] = time.perf_counter() - run.t_job
    first = run.ledger.first_row_at
    summary["first_row_s"] = None if first is None else first - run.t_job  # job start to the first row back
    tally, before = run.ledger.tally, run.earlier or EarlierRuns()
    redone = int((run.todo.seen & before.retried).sum()) if before.retried is not None else 0
    job_ok, job_failed = before.ok + tally.ok, before.failed - redone + tally.failed
    code = run_exit_code(summary["failed"], cfg.allow_failures, run.stopped)
    plan = run.plan
    summary.update(
        job_id=cfg.job_id, run_id=run.run_id, config_hash=cfg.config_hash(), input=run.source.uri,
        output=run.output.uri, device=plan.device if plan else None, num_actors=plan.num_actors if plan else 0,
        method=cfg.decode.method, engine_batch=cfg.decode.batch_size, budget=_budget(cfg),
        job_ok=job_ok, job_failed=job_failed, durable_rows=run.ledger.rows_written, ledger_parts=run.ledger.seq,
        status=RUN_STATUS.get(code, "done"),
        exit_code=code, error=str(run.stopped) if run.stopped else None,
        pool_passes=run.pool.get("passes", 0), actor_restarts=run.pool.get("actor_restarts", 0),
        duplicate_rows_dropped=run.pool.get("duplicates_dropped", 0),
    )
    return summary, code


def _budget(cfg: JobConfig) -> Optional[str]:
    """The engine's draft budget mode ('cost', ...) when the job's method drafts adaptively."""
    return cfg.decode.adaptive.budget if cfg.decode.method == "adt" else None


def _report(run: _Run, summary: dict[str, Any], code: int) -> JobResult:
    """Write summary.json and the run record, print the summary and what the exit code means."""
    cfg, output, say = run.cfg, run.output, run.say
    where = {"images": output.uri_for("images" if cfg.output_format == "files" else "shards"),
             "telemetry": output.uri_for(TELEMETRY_DIR), "summary": output.uri_for("summary.json"),
             "config": output.uri_for("job.json")}
    try:
        output.put_text("summary.json", json.dumps(summary, indent=2, default=str) + "\n", "application/json")
        finish_record(output, cfg, run.run_id, {"exit_code": code, "status": summary["status"], "ok": summary["ok"],
                                                "failed": summary["failed"], "skipped": run.skipped})
    except StorageUnavailable as e:
        code = EXIT_STORAGE_UNAVAILABLE
        summary.update(status="storage unavailable", exit_code=code, error=summary["error"] or str(e))
        where["summary"] = "(not written: storage unavailable)"
    print(format_summary(summary, title=f"job {cfg.job_id}", where=where, report_hint=report_args(cfg)),
          file=run.stream, flush=True)
    if summary["actor_restarts"] or summary["pool_passes"] > 1:
        say(f"faults survived: {summary['actor_restarts']} actor restart(s), {summary['pool_passes']} pass(es) over "
            f"the prompts, {summary['duplicate_rows_dropped']} repeated row(s) dropped")
    if summary["error"]:
        say(f"error: {summary['error']}")
    if code == EXIT_ROWS_FAILED:
        say(f"{summary['failed']} row(s) failed: exit code {code} (pass --allow-failures to exit 0)")
    elif code != EXIT_OK:
        say(f"exit code {code}: {EXIT_CODES[code]}")
    return JobResult(summary=summary, exit_code=code, output_uri=output.uri)


def main_guarded(cfg: JobConfig, stream: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """run_job with every way it can end turned into one line and a documented exit code."""
    stream = sys.stdout if stream is None else stream
    err = sys.stderr if err is None else err
    try:
        return run_job(cfg, stream).exit_code
    except (JobRefused, ConfigError) as e:
        print(f"error: {e}", file=err, flush=True)
        return getattr(e, "exit_code", EXIT_BAD_INPUT)
    except StorageUnavailable as e:
        print(f"error: {e}", file=err, flush=True)
        return EXIT_STORAGE_UNAVAILABLE
    except ClusterUnavailable as e:
        print(f"error: {e}", file=err, flush=True)
        return EXIT_NO_RESOURCES
    except JobInterrupted as e:
        print(f"error: {e} before any work was done", file=err, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug: say so, distinctly from "rows failed"
        log.exception("internal error")
        print(f"error: internal error: {type(e).__name__}: {e}", file=err, flush=True)
        return EXIT_INTERNAL
