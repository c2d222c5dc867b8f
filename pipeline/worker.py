"""The generator worker: a callable class that Ray Data runs in a pool of actors.

`GeneratorWorker(config)` loads the bundle once (per actor); each call takes one batch of
prompt rows (a pyarrow Table with prompt_id, prompt[, seed]) and returns one telemetry row
per prompt (`pipeline.telemetry.SCHEMA`). It is plain Python: tests call it without Ray.

The whole Ray batch goes through one engine stream: up to `decode.batch_size` images in
flight, the next prompt admitted as soon as one finishes. Order per prompt: the image
finishes -> store the PNG at <output>/images/<safe prompt id>.png -> its row (with
`output_format` webdataset / parquet the call's images go into shards, written before the
call returns its rows: pipeline.shards). The driver
writes rows after the batch returns, so an ok row always means the image exists; a retried
batch rewrites the same keys (no duplicates). The AR baseline (a sampled fraction of prompts)
decodes afterwards, all sampled prompts of the batch together at the same engine batch size.

Failures: an invalid row or an exception while generating/storing one prompt becomes a
failed row; a prompt the engine cannot take (e.g. its caption fails to encode) fails alone
while the others stay in flight. When the engine itself raises mid-batch, the prompts not
finished yet are retried one by one so one bad prompt fails alone. Only an unrecoverable error (out of memory twice, a dead CUDA device)
ends the actor process; Ray restarts it and retries the batch.

Test-only fault switch: ADT_PIPELINE_FAULT=kill_once:<marker file> makes the first actor
that stores an image mid-batch create the marker and SIGKILL itself (once per marker).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import signal
import socket
import time
from typing import Any, Iterator, Optional

import pyarrow as pa

from pipeline.config import JobConfig, StorageSettings
from pipeline.costs import attach_costs
from pipeline.metrics import WorkerMetrics
from pipeline.prompts import MAX_SEED, derived_seed, row_problem
from pipeline.shards import Sample, sample_key, write_shards
from pipeline.storage import image_key, open_storage
from pipeline.telemetry import RowContext, add_baseline, calibrate_estimates, failed_row, ok_row, to_table

log = logging.getLogger(__name__)

FAULT_ENV = "ADT_PIPELINE_FAULT"


class WorkerDied(RuntimeError):
    """An unrecoverable engine failure outside Ray (inside Ray the process exits instead)."""


def load_bundle_spec(spec: str, storage: Optional["StorageSettings"] = None):
    """A bundle from its spec: 'random' / 'random:<seed>' (tiny random weights, for tests
    and smoke runs), an embedded bundle name, a bundle directory, or a manifest whose s3://
    checkpoints are read with the job's storage settings (one configuration for both)."""
    import adt_core
    from adt_core.models.manifest import is_manifest_path, load_manifest_bundle

    if spec == "random" or spec.startswith("random:"):
        seed = int(spec.partition(":")[2] or 0)
        return adt_core.random_bundle(seed=seed)
    if is_manifest_path(spec):
        from pipeline.s3 import model_s3_client

        return load_manifest_bundle(spec, s3_client_factory=lambda: model_s3_client(storage))
    return adt_core.load_bundle(spec)


def resolve_device(requested: str) -> str:
    """The torch device for this process: 'cuda:0' (Ray maps the actor's GPU to index 0)
    or 'cpu'. 'auto' takes CUDA when this process can see a GPU."""
    import torch

    if requested in ("cuda", "auto") and torch.cuda.is_available():
        return "cuda:0"
    if requested == "cuda":
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device in this process")
    return "cpu"


def encode_png(image: Any) -> bytes:
    """uint8 (H, W, 3) array or PIL image -> PNG bytes."""
    from PIL import Image

    img = image if isinstance(image, Image.Image) else Image.fromarray(image)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def in_baseline_sample(prompt_id: str, fraction: float) -> bool:
    """Deterministic choice of the prompts also decoded with vanilla AR."""
    if fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(("baseline\x00" + prompt_id).encode("utf-8", "surrogatepass")).digest()[:8], "little")
    return h / 2**64 < fraction


def _is_fatal(err: BaseException) -> bool:
    """Errors after which this process cannot be trusted to generate (device or memory)."""
    import torch

    if isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(err)
    return "CUDA error" in text or "device-side assert" in text or "CUBLAS_STATUS" in text


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _ray_context() -> tuple[str, str, bool]:
    """(actor id, node id, inside a Ray actor)."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            actor = ctx.get_actor_id()
            return actor or "driver", ctx.get_node_id(), actor is not None
    except Exception:  # noqa: BLE001 - no Ray, or not a Ray process
        pass
    return "local", "local", False


class GeneratorWorker:
    """Callable class for `Dataset.map_batches(..., batch_format="pyarrow")`."""

    def __init__(self, config: dict | JobConfig, device: Optional[str] = None, fault: Optional[str] = None,
                 num_threads: Optional[int] = None, run_id: Optional[str] = None):
        import torch

        import adt_core

        self.cfg = config if isinstance(config, JobConfig) else JobConfig.model_validate(config)
        self.fault = fault if fault is not None else os.environ.get(FAULT_ENV)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = resolve_device(device or self.cfg.device)
        self.storage = open_storage(self.cfg.output, self.cfg.storage)
        t0 = time.perf_counter()
        self.bundle = load_bundle_spec(self.cfg.bundle, self.cfg.storage)
        self.generator = adt_core.Generator(self.bundle, self.cfg.decode.engine_config(self.device))
        self.baseline = None
        if self.cfg.baseline_fraction > 0:
            self.baseline = adt_core.Generator(self.bundle, self.cfg.decode.engine_config(self.device, method="ar"))
        actor, node, self.in_actor = _ray_context()
        dev_name = self.device
        if self.device.startswith("cuda"):
            dev_name += f" ({torch.cuda.get_device_name(0)})"
        self.ctx = RowContext(
            job_id=self.cfg.job_id, bundle=self.bundle.name, method=self.cfg.decode.method,
            config_hash=self.cfg.config_hash(), run_id=run_id, actor_id=actor, node_id=node, hostname=socket.gethostname(),
            device=dev_name,
        )
        self.costs = attach_costs(self.generator, self.storage, dev_name)  # one cost table per job (resume too)
        self.metrics = WorkerMetrics(self.cfg.decode.method, self.bundle.name)
        log.info("worker ready: bundle %s on %s in %.1f s (actor %s)", self.bundle.name, dev_name,
                 time.perf_counter() - t0, actor)

    # ---- one batch ------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist() if isinstance(batch, pa.Table) else _dict_batch_rows(batch)
        out: list[Optional[dict]] = [None] * len(rows)
        todo: list[tuple[int, str, str, int]] = []  # (row index, prompt id, prompt, seed)
        for i, r in enumerate(rows):
            pid, prompt, seed = r["prompt_id"], r.get("prompt"), r.get("seed")
            problem = row_problem(prompt, seed, self.cfg.max_prompt_chars)
            if problem:
                keep = seed if seed is not None and -(2**63) <= seed <= MAX_SEED else None  # fits the int64 column
                out[i] = failed_row(self.ctx, pid, keep, problem, prompt=prompt)
            else:
                todo.append((i, pid, prompt, seed if seed is not None else derived_seed(pid, self.cfg.seed)))

        stored, baseline, samples = 0, [], []
        sharded = self.cfg.output_format != "files"
        for j, res in self._stream([t[2] for t in todo], [t[3] for t in todo]):  # as images finish
            i, pid, prompt, seed = todo[j]
            if isinstance(res, BaseException):
                out[i] = failed_row(self.ctx, pid, seed, _describe(res), prompt=prompt)
                continue
            try:
                png = encode_png(res.image)
                key = None if sharded else image_key(pid)
                if key is not None:
                    self.storage.put_bytes(key, png, "image/png")  # image before its row
                row = ok_row(self.ctx, pid, seed, key, res, prompt=prompt)
                row["generation_time_ms"] = res.stats.total_ms  # this image's share of its rounds
            except Exception as e:  # noqa: BLE001 - a storage or encoding error fails this row only
                log.warning("prompt %s failed after generation: %s", pid, _describe(e))
                out[i] = failed_row(self.ctx, pid, seed, _describe(e), prompt=prompt)
                continue
            if self.baseline is not None and in_baseline_sample(pid, self.cfg.baseline_fraction):
                baseline.append((row, prompt, seed))
            if sharded:
                samples.append((i, Sample(sample_key(pid), png, row)))
            out[i] = row
            stored += 1
            if stored == 1 and len(todo) > 1:
                self._maybe_fault()
        self._add_baselines(baseline)
        calibrate_estimates([r for r in out if r is not None and r.get("status") == "ok"])
        if samples:
            self._write_shards(samples, out)
        self.metrics.record(out)
        return to_table(out)

    def _write_shards(self, samples: list[tuple[int, Sample]], out: list[Optional[dict]]) -> None:
        """Shards of this call's images, before their rows leave (a failed write fails its rows)."""
        try:
            write_shards(self.storage, self.cfg.output_format, [s for _, s in samples], self.cfg.shard_size)
        except Exception as e:  # noqa: BLE001 - the store refused: these rows have no image
            log.warning("writing %d image(s) into shards failed: %s", len(samples), _describe(e))
            for i, s in samples:
                r = s.row
                out[i] = failed_row(self.ctx, r["prompt_id"], r["seed"], _describe(e), prompt=r["prompt"])

    # ---- helpers --------------------------------------------------------------------------
    def _stream(self, prompts: list[str], seeds: list[int]) -> Iterator[tuple[int, Any]]:
        """(index, result or exception) per prompt as images finish: the whole batch in flight in
        one engine (continuous refill); after an engine error, the unfinished prompts one by one."""
        from adt_core.results import PromptFailure

        if not prompts:
            return
        done: set[int] = set()
        try:
            for j, res in self.generator.stream(prompts, seeds):
                done.add(j)
                yield j, (res.error if isinstance(res, PromptFailure) else res)
            return
        except Exception as e:  # noqa: BLE001
            log.warning("batch of %d failed after %d images (%s); retrying one by one", len(prompts), len(done),
                        _describe(e))
            if _is_fatal(e):
                self._free_memory()
        for j, (p, s) in enumerate(zip(prompts, seeds)):
            if j in done:
                continue
            try:
                yield j, self.generator.generate([p], [s])[0]
            except Exception as e:  # noqa: BLE001
                if _is_fatal(e):
                    self._die(e)
                yield j, e

    def _add_baselines(self, rows: list[tuple[dict, str, int]]) -> None:
        """Decode the sampled prompts with `ar` at the job's engine batch size, together."""
        if not rows:
            return
        try:
            results = self.baseline.generate([p for _, p, _ in rows], [s for _, _, s in rows])
        except Exception as e:  # noqa: BLE001 - the measurement is optional; the images are fine
            if _is_fatal(e):
                self._die(e)
            log.warning("baseline for %d prompts failed: %s", len(rows), _describe(e))
            return
        for (row, _, _), res in zip(rows, results):
            add_baseline(row, res)

    def _free_memory(self) -> None:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _die(self, err: BaseException) -> None:
        log.error("unrecoverable engine failure, ending this worker: %s", _describe(err))
        if self.in_actor:
            logging.shutdown()
            os._exit(70)  # Ray restarts the actor and retries the batch
        raise WorkerDied(_describe(err)) from err

    def _maybe_fault(self) -> None:
        """Test-only: SIGKILL this actor once, mid-batch (see module docstring)."""
        if not self.fault or not self.fault.startswith("kill_once:") or not self.in_actor:
            return
        marker = self.fault.partition(":")[2]
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        log.error("fault switch: killing actor process %d mid-batch", os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def _dict_batch_rows(batch: dict) -> list[dict]:
    cols = list(batch)
    n = len(batch[cols[0]]) if cols else 0
    return [{c: (batch[c][i].item() if hasattr(batch[c][i], "item") else batch[c][i]) for c in cols} for i in range(n)]
