"""The job driver: prompts (Parquet) -> Ray Data actor pool of GeneratorWorkers -> ledger.

    read_parquet(prompts) -> keep the selected ids (limit, resume) -> repartition so every
    actor gets work -> map_batches(GeneratorWorker, ActorPoolStrategy(size=N), GPUs or
    fractional CPUs per actor) -> the driver writes each returned batch of rows durably
    (pipeline.ledger), then compacts them at the end

then `summary.json` and a one-screen summary. Everything that can be refused is refused
before Ray starts: the config (the engine's DecodeConfig and sampling included), the prompt
input (every page of every column read), the output's lease, a resume with another config.

Output layout (rooted at JobConfig.output, a path or s3:// prefix):

    lease.json               held while a job writes here (pipeline.lease)
    job.json                 the JobConfig of the first run, with its config_hash
    runs/<run id>.json       one record per run: its config, hash, end, counts (pipeline.history)
    images/<id>.png          one image per ok prompt (id sanitised by storage.safe_name)
    telemetry/*.parquet      one row per processed prompt (pipeline.telemetry.SCHEMA)
    summary.json             counts, throughput, speedups of the latest run

Exit codes (EXIT_CODES; docs/pipeline.md):
    0 done            1 some rows failed      2 config / input / resume refused
    3 Ray cluster unreachable or too small    4 storage unavailable
    5 output in use by another job (lease)    6 interrupted (SIGTERM / SIGINT)
    7 internal error (a bug: traceback logged)
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, TextIO

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.checks import JobRefused, check_bundle, check_engine_config
from pipeline.cluster import ActorPlan, ClusterUnavailable, connect
from pipeline.execute import JobInterrupted, execute
from pipeline.config import DEFAULT_INPUT, ConfigError, JobConfig, packaged_input
from pipeline.history import ConfigChanged, check_and_record, finish_record
from pipeline.lease import Lease, LeaseHeld
from pipeline.ledger import Ledger, compact, latest_per_prompt, read_telemetry
from pipeline.prompts import PromptInputError, PromptSource, open_prompts, select_ids
from pipeline.shards import SAMPLE_COLUMNS, finish_outputs
from pipeline.retry import StorageUnavailable
from pipeline.storage import Storage, is_remote, open_storage, parse_uri
from pipeline.telemetry import STATUS_OK, TELEMETRY_DIR, format_summary, summarize

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ROWS_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_RESOURCES = 3
EXIT_STORAGE_UNAVAILABLE = 4
EXIT_OUTPUT_BUSY = 5
EXIT_INTERRUPTED = 6
EXIT_INTERNAL = 7
EXIT_CODES = {
    EXIT_OK: "done: every selected prompt has an ok row",
    EXIT_ROWS_FAILED: "the run finished but some rows failed (--allow-failures makes it 0)",
    EXIT_BAD_INPUT: "the config, the prompt input or a resume was refused before any work",
    EXIT_NO_RESOURCES: "the Ray cluster cannot be reached or cannot host the actors",
    EXIT_STORAGE_UNAVAILABLE: "the input or output store is unavailable (down past storage.retry_budget_s, or refused)",
    EXIT_OUTPUT_BUSY: "another job holds the output's lease",
    EXIT_INTERRUPTED: "stopped by SIGTERM / SIGINT; what was done is in the telemetry and summary",
    EXIT_INTERNAL: "an unexpected error (a bug); the traceback is logged",
}


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

    def __call__(self, msg: str) -> None:
        print(f"[generate] {msg}", file=self.stream, flush=True)


class _Signals:
    """SIGTERM / SIGINT raise JobInterrupted in the main thread (once; a second signal acts
    as it normally would). Outside the main thread nothing is installed."""

    def __init__(self):
        self.previous: dict[int, Any] = {}
        self.active = threading.current_thread() is threading.main_thread()

    def _handle(self, signum, frame):
        self.restore()
        raise JobInterrupted(signum)

    def install(self) -> None:
        if self.active:
            for sig in (signal.SIGTERM, signal.SIGINT):
                prev = signal.signal(sig, self._handle)
                self.previous.setdefault(sig, prev)

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev)
        self.previous = {}


def run_job(cfg: JobConfig, stream: Optional[TextIO] = None) -> JobResult:
    """Run one generation job end to end; raises JobRefused / StorageUnavailable /
    ClusterUnavailable / LeaseHeld / JobInterrupted when nothing could be done, else
    returns the summary and the exit code (EXIT_CODES)."""
    signals = _Signals()
    signals.install()
    try:
        return _run(cfg, sys.stdout if stream is None else stream, signals)
    finally:
        signals.restore()


def _run(cfg: JobConfig, stream: TextIO, signals: _Signals) -> JobResult:
    t_job = time.perf_counter()
    say = _Printer(stream)
    cfg = _absolute(cfg)
    check_engine_config(cfg)
    check_bundle(cfg)
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
    try:
        return _run_leased(cfg, stream, signals, say, output, source, run_id, lease, bool(existing), t_job)
    finally:
        lease.release()


def _run_leased(cfg: JobConfig, stream: TextIO, signals: _Signals, say: _Printer, output: Storage,
                source: PromptSource, run_id: str, lease: Lease, existing: bool, t_job: float) -> JobResult:
    if existing:
        merged = compact(output, cfg.telemetry_rows_per_file)  # parts left by a run that was killed
        if merged:
            say(f"compacted {merged} telemetry part(s) left by an earlier run")
    try:
        earlier_hash = check_and_record(output, cfg, run_id)
    except ConfigChanged as e:
        raise JobRefused(str(e)) from None
    if earlier_hash:
        say(f"WARNING: resuming a job made with config {earlier_hash}; new rows get config {cfg.config_hash()}")
    cols = ["prompt_id", "status", "finished_at"]
    earlier = read_telemetry(output, columns=cols) if cfg.resume else None
    done = set(earlier.filter(pc.equal(earlier["status"], STATUS_OK))["prompt_id"].to_pylist()) if earlier else set()
    todo, skipped = select_ids(source, cfg.limit, done)
    wanted = len(todo) + skipped
    say(f"job {cfg.job_id} (config {cfg.config_hash()}, run {run_id}): {len(source.ids)} prompt(s) in {source.uri}, "
        f"{wanted} selected, {skipped} already done, output {output.uri}")

    ledger = Ledger(output, run_id, cfg.ledger_flush_rows)
    plan: Optional[ActorPlan] = None
    stopped: Optional[BaseException] = None  # why the run ended early
    t_exec = time.perf_counter()
    if todo:
        started = False
        try:
            started = connect(cfg, say)
            signals.install()  # ray.init in the main thread installs its own SIGTERM handler
            lease.on_lost = lambda: _thread.interrupt_main(signal.SIGINT)
            t_exec = time.perf_counter()
            plan = execute(cfg, source, todo, ledger, say, run_id)
        except (JobInterrupted, StorageUnavailable) as e:
            stopped = e
        finally:
            lease.on_lost = None
            if started:
                import ray

                ray.shutdown()
    exec_s = time.perf_counter() - t_exec if todo else 0.0
    if isinstance(stopped, JobInterrupted) and lease.lost:
        stopped = StorageUnavailable(output.uri, f"the output lease could not be renewed: {lease.lost}")
    if isinstance(stopped, JobInterrupted):
        say(f"{stopped}: finishing what was done")

    wrote: list[str] = []
    try:
        ledger.flush()
        compact(output, cfg.telemetry_rows_per_file)
        if not isinstance(stopped, StorageUnavailable):
            cols_out = list(dict.fromkeys(cols + ["image_key"] + SAMPLE_COLUMNS))
            done = finish_outputs(output, cfg.output_format, read_telemetry(output, columns=cols_out))
            if done.get("rewritten") or done.get("deleted"):
                say(f"shards: {done['rewritten']} rewritten, {done['deleted']} deleted (images of rows that were "
                    f"not durable, now in another shard)")
    except StorageUnavailable as e:
        stopped = stopped if isinstance(stopped, StorageUnavailable) else e
    summary = summarize(ledger.rows(), wall_time_s=exec_s, skipped=skipped, total_input=wanted)
    summary["job_wall_time_s"] = time.perf_counter() - t_job
    mine = ledger.rows().select(cols)
    everything = pa.concat_tables([earlier.select(cols).cast(mine.schema), mine]) if earlier is not None else mine
    statuses = latest_per_prompt(everything)["status"].to_pylist()
    code = _exit_code(cfg, summary, stopped)
    summary.update(
        job_id=cfg.job_id, run_id=run_id, config_hash=cfg.config_hash(), input=source.uri, output=output.uri,
        device=plan.device if plan else None, num_actors=plan.num_actors if plan else 0,
        job_ok=statuses.count("ok"), job_failed=statuses.count("failed"), durable_rows=ledger.rows_written,
        status={EXIT_INTERRUPTED: "interrupted", EXIT_STORAGE_UNAVAILABLE: "storage unavailable"}.get(code, "done"),
        exit_code=code, error=str(stopped) if stopped else None,
    )
    where = {"images": output.uri_for("images" if cfg.output_format == "files" else "shards"), "telemetry": output.uri_for(TELEMETRY_DIR),
             "summary": output.uri_for("summary.json"), "config": output.uri_for("job.json")}
    try:
        output.put_text("summary.json", json.dumps(summary, indent=2, default=str) + "\n", "application/json")
        finish_record(output, cfg, run_id, {"exit_code": code, "status": summary["status"], "ok": summary["ok"],
                                            "failed": summary["failed"], "skipped": skipped})
        wrote.append("summary")
    except StorageUnavailable as e:
        code = EXIT_STORAGE_UNAVAILABLE
        summary.update(status="storage unavailable", exit_code=code, error=summary["error"] or str(e))
        where["summary"] = "(not written: storage unavailable)"
    print(format_summary(summary, title=f"job {cfg.job_id}", where=where), file=stream, flush=True)
    if summary["error"]:
        say(f"error: {summary['error']}")
    failed = summary["failed"]
    if code == EXIT_ROWS_FAILED:
        say(f"{failed} row(s) failed: exit code {code} (pass --allow-failures to exit 0)")
    elif code != EXIT_OK:
        say(f"exit code {code}: {EXIT_CODES[code]}")
    return JobResult(summary=summary, exit_code=code, output_uri=output.uri)


def _exit_code(cfg: JobConfig, summary: dict[str, Any], stopped: Optional[BaseException]) -> int:
    if isinstance(stopped, StorageUnavailable):
        return EXIT_STORAGE_UNAVAILABLE
    if isinstance(stopped, JobInterrupted):
        return EXIT_INTERRUPTED
    return EXIT_ROWS_FAILED if summary["failed"] and not cfg.allow_failures else EXIT_OK


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
