"""The generator worker: a callable class that Ray Data runs in a pool of actors.

`GeneratorWorker(config)` loads the bundle once per actor and says so in one line, with how
long loading and the cost table took. Each call takes one batch of prompt rows (a pyarrow
Table with prompt_id, prompt[, seed]) and yields telemetry rows (`pipeline.telemetry.SCHEMA`)
as images finish, so the driver's progress moves per image, not per call. It is plain Python:
tests call `run(batch)` (every row as one table) without Ray.

The whole Ray batch goes through one engine stream: up to `decode.batch_size` images in
flight, the next prompt admitted as soon as one finishes. Order per prompt: the image
finishes -> store the PNG at <output>/images/<safe prompt id>.png -> its row. Each PNG is
encoded and stored by a bounded pool of writer threads (pipeline.writer) while the engine
decodes on; after every engine round the call collects the finished writes, so a row joins the
outbox at most a round after its image is durable. (The engine stays in the call's own thread:
on CPU, torch's OpenMP matmuls run ~25% slower from a second Python thread.) Rows leave in
chunks, at most one every YIELD_EVERY_S (the rest when the call ends), each chunk packed
into one Arrow row (`pack`) so Ray Data hands it on at once instead of merging it into a
block of its own size target. The driver writes rows as they arrive, so an ok row always
means the image exists; a retried batch rewrites the same keys (no duplicates).

With `store_images=False` (pipeline.processor, the engine as a Ray Data stage) the PNGs are
not written: the worker keeps each one until `take_pngs` collects it beside its row.

A sampled fraction of prompts (`baseline_fraction`) is also decoded with vanilla AR before
the batch itself, at the occupancy the speculative engine has: the measured prompts are
decoded together with other prompts of the call (whose AR images are dropped) so that AR runs
with as many images in flight as the batch does (`_baselines`; each image's time is its share
of its rounds, so AR with fewer images in flight would look slower per image on a device
whose forward is flat in batch size). A row's speedup is set only when the two occupancies
agree (telemetry.like_for_like). The measured prompts enter the engine first, and the
batch's rows wait until they have finished, so every row's estimated speedup is calibrated
on the batch's like-for-like measured rows (`pipeline.outbox.Outbox`). With output_format
webdataset / parquet, rows leave once their images are in a written shard
(`shard_size` images, or the call's images when the call ends: pipeline.shards).

Failures: an invalid row or an exception while generating/storing one prompt becomes a
failed row; a prompt the engine cannot take (e.g. its caption fails to encode) fails alone
while the others stay in flight. When the engine itself raises mid-batch, the prompts not
finished yet are retried one by one so one bad prompt fails alone. Only an unrecoverable
error (out of memory twice, a dead CUDA device) ends the actor process; Ray restarts it and
retries the batch.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pyarrow as pa

from pipeline.checks import actor_memory_plan
from pipeline.config import JobConfig, StorageSettings
from pipeline.costs import attach_costs
from pipeline.metrics import WorkerMetrics
from pipeline.progress import quiet_progress_bars
from pipeline.prompts import MAX_SEED, derived_seed, row_problem
from pipeline.shards import Sample, sample_key, write_shards
from pipeline.storage import image_key, open_storage
from pipeline.telemetry import RowContext, add_baseline, empty_table, failed_row, ok_row
from pipeline.outbox import Outbox, pack, unpack  # noqa: F401 - pack / unpack: the worker's chunk format
from pipeline.writer import ImageWriter

log = logging.getLogger(__name__)

YIELD_EVERY_S = 0.25  # rows leave a call at most this often (one Ray object and one ledger part each)
class WorkerDied(RuntimeError):
    """An unrecoverable engine failure outside Ray (inside Ray the process exits instead)."""


def load_bundle_spec(spec: str, storage: Optional["StorageSettings"] = None):
    """A bundle from its spec: 'random' / 'random:<seed>' (tiny random weights, for tests
    and smoke runs), an embedded bundle name, a bundle directory, or a manifest whose s3://
    checkpoints are read with the job's storage settings (one configuration for both)."""
    import adt_core
    from adt_core.bundles.loader import load_any_manifest
    from adt_core.bundles.manifest import is_manifest_path

    if spec == "random" or spec.startswith("random:"):
        seed = int(spec.partition(":")[2] or 0)
        return adt_core.random_bundle(seed=seed)
    if is_manifest_path(spec):
        from pipeline.s3 import model_s3_client

        return load_any_manifest(spec, s3_client_factory=lambda: model_s3_client(storage))
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


def _process_age() -> float:
    """Seconds since this process started (imports and Ray's actor start-up included)."""
    try:
        import psutil  # a Ray dependency

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - not essential
        return 0.0


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

    def __init__(self, config: dict | JobConfig, device: Optional[str] = None, num_threads: Optional[int] = None,
                 run_id: Optional[str] = None, store_images: bool = True):
        """store_images=False: PNGs are kept for `take_pngs` instead of written to the output
        (pipeline.processor: images as columns); rows then have no image_key."""
        import torch

        import adt_core

        self.cfg = config if isinstance(config, JobConfig) else JobConfig.model_validate(config)
        quiet_progress_bars(show=self.cfg.progress)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = resolve_device(device or self.cfg.device)
        self.storage = open_storage(self.cfg.output, self.cfg.storage)
        t0 = time.perf_counter()
        self.bundle = load_bundle_spec(self.cfg.bundle, self.cfg.storage)
        self.memory = actor_memory_plan(self.cfg, self.bundle, self.device)  # in flight here (<= decode.batch_size)
        in_flight = self.memory.images
        self.generator = adt_core.Generator(self.bundle, self.cfg.decode.engine_config(self.device, batch_size=in_flight))
        self.baseline = None
        if self.cfg.baseline_fraction > 0:
            self.baseline = adt_core.Generator(self.bundle, self.cfg.decode.engine_config(self.device, method="ar",
                                                                                          batch_size=in_flight))
        actor, node, self.in_actor = _ray_context()
        dev_name = self.device
        if self.device.startswith("cuda"):
            dev_name += f" ({torch.cuda.get_device_name(0)})"
        self.ctx = RowContext(
            job_id=self.cfg.job_id, bundle=self.bundle.name, method=self.cfg.decode.method,
            config_hash=self.cfg.config_hash(), run_id=run_id, actor_id=actor, node_id=node, hostname=socket.gethostname(),
            device=dev_name,
        )
        t1 = time.perf_counter()
        costs = attach_costs(self.generator, self.storage, dev_name)  # one cost table per job (resume too)
        self.metrics = WorkerMetrics(self.cfg.decode.method, self.bundle.name)
        t2 = time.perf_counter()
        cost_note = "" if costs == "unused" else f", cost table {costs} in {t2 - t1:.1f} s"
        self.ready_line = (f"worker ready {_process_age():.0f} s after its process started: bundle {self.bundle.name} "
                           f"loaded in {t1 - t0:.1f} s{cost_note} ({dev_name}, {in_flight} in flight); {self.memory.line()}")
        self.writer = ImageWriter(self._row, max_pending=max(2 * in_flight, 16))
        self.store_images = store_images
        self._kept: dict[str, deque[bytes]] = {}  # prompt id -> PNGs not stored (store_images=False)
        self._kept_lock = threading.Lock()  # writer threads add, the yielding thread takes
        self.decode_s = self.write_wait_s = 0.0  # the last call's decode loop, and its time blocked on writes
        if self.in_actor:
            print(self.ready_line, flush=True)  # Ray forwards it to the driver's console and job logs
        else:
            log.info("%s", self.ready_line)

    # ---- one batch ------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        """Ray Data's entry point: one batch of prompt rows in, packed chunks of telemetry rows
        out as images finish (`pack`; at most one chunk every YIELD_EVERY_S, the rest at the end)."""
        out = Outbox(self, self.cfg.output_format != "files", YIELD_EVERY_S)
        prompts = []
        for r in batch.to_pylist() if isinstance(batch, pa.Table) else _dict_batch_rows(batch):
            pid, prompt, seed = r["prompt_id"], r.get("prompt"), r.get("seed")
            problem = row_problem(prompt, seed, self.cfg.max_prompt_chars)
            if problem:
                keep = seed if seed is not None and -(2**63) <= seed <= MAX_SEED else None  # fits the int64 column
                out.add(failed_row(self.ctx, pid, keep, problem, prompt=prompt))
                continue
            seed = seed if seed is not None else derived_seed(pid, self.cfg.seed)
            measured = self.baseline is not None and in_baseline_sample(pid, self.cfg.baseline_fraction)
            prompts.append(_Prompt(pid, prompt, seed, measured))
        prompts.sort(key=lambda p: not p.measured)  # measured first: their rows calibrate the others' estimates
        baselines = self._baselines(prompts)
        out.expect_measured(set(baselines))
        t0, wait0 = time.perf_counter(), self.writer.wait_s
        for item in self._stream(prompts):  # finished images, and a tick (None) after every engine round
            if item is not None:
                p, res = item
                for done in self.writer.submit(p, res, baselines.get(p.prompt_id)):  # stored by the writer pool
                    out.add(*done)
            for done in self.writer.done():  # writes finished meanwhile: their rows may leave
                out.add(*done)
            if out.due():
                yield from out.release()
        self.decode_s, self.write_wait_s = time.perf_counter() - t0, self.writer.wait_s - wait0
        for done in self.writer.drain():  # every image durable before the call's last rows
            out.add(*done)
        yield from out.release(final=True)

    def run(self, batch: pa.Table) -> pa.Table:
        """Every row of one batch as one table (plain Python use: tests, notebooks)."""
        return pa.concat_tables([unpack(chunk) for chunk in self(batch)] or [empty_table()])

    def _row(self, p: "_Prompt", res: Any, baseline: Optional[tuple[Any, float]]) -> tuple[dict, Optional[Sample]]:
        """The row of one finished prompt (its PNG stored first, unless it goes into a shard)."""
        if isinstance(res, BaseException):
            return failed_row(self.ctx, p.prompt_id, p.seed, _describe(res), prompt=p.prompt), None
        sharded = self.cfg.output_format != "files"
        try:
            png = encode_png(res.image)
            key = None if sharded or not self.store_images else image_key(p.prompt_id)
            if key is not None:
                self.storage.put_bytes(key, png, "image/png")  # image before its row
            row = ok_row(self.ctx, p.prompt_id, p.seed, key, res, prompt=p.prompt)
            if key is None and not sharded:
                with self._kept_lock:
                    self._kept.setdefault(p.prompt_id, deque()).append(png)
        except Exception as e:  # noqa: BLE001 - a storage or encoding error fails this row only
            log.warning("prompt %s failed after generation: %s", p.prompt_id, _describe(e))
            return failed_row(self.ctx, p.prompt_id, p.seed, _describe(e), prompt=p.prompt), None
        if baseline is not None:
            add_baseline(row, *baseline)
        return row, (Sample(sample_key(p.prompt_id), png, row) if sharded else None)

    def take_pngs(self, prompt_ids: list[str]) -> list[Optional[bytes]]:
        """The kept PNG of each prompt id (store_images=False; None for a failed row), in order."""
        out = []
        with self._kept_lock:
            for pid in prompt_ids:
                kept = self._kept.get(pid)
                out.append(kept.popleft() if kept else None)
                if kept is not None and not kept:
                    del self._kept[pid]
        return out

    def write_shards(self, samples: list[Sample]) -> list[dict]:
        """Shards of these images, before their rows leave; returns the rows (failed ones when
        the store refused: those rows have no image)."""
        try:
            write_shards(self.storage, self.cfg.output_format, samples, self.cfg.shard_size)
            return [s.row for s in samples]
        except Exception as e:  # noqa: BLE001
            log.warning("writing %d image(s) into shards failed: %s", len(samples), _describe(e))
            return [failed_row(self.ctx, s.row["prompt_id"], s.row["seed"], _describe(e), prompt=s.row["prompt"])
                    for s in samples]

    # ---- helpers --------------------------------------------------------------------------
    def _stream(self, prompts: list["_Prompt"]) -> Iterator[Optional[tuple["_Prompt", Any]]]:
        """(prompt, result or exception) as images finish, and None after every engine round (the
        caller's moment to hand on rows whose writes finished): the whole batch in flight in one
        engine (continuous refill); after an engine error, the unfinished prompts one by one."""
        from adt_core.results import PromptFailure

        if not prompts:
            return
        done: set[int] = set()
        try:
            for finished in self.generator.rounds([p.prompt for p in prompts], [p.seed for p in prompts]):
                for j, res in finished:
                    done.add(j)
                    yield prompts[j], (res.error if isinstance(res, PromptFailure) else res)
                yield None
            return
        except Exception as e:  # noqa: BLE001
            log.warning("batch of %d failed after %d images (%s); retrying one by one", len(prompts), len(done),
                        _describe(e))
            if _is_fatal(e):
                self._free_memory()
        for j, p in enumerate(prompts):
            if j in done:
                continue
            try:
                yield p, self.generator.generate([p.prompt], [p.seed])[0]
            except Exception as e:  # noqa: BLE001
                if _is_fatal(e):
                    self._die(e)
                yield p, e

    def _baselines(self, prompts: list["_Prompt"]) -> dict[str, tuple[Any, float]]:
        """prompt id -> (its vanilla AR result, AR images in flight) for the measured prompts,
        decoded before the batch at the batch's occupancy: with other prompts of the call as
        filler up to a whole number of engine waves (AR images all finish together, so each
        wave runs full). Empty when nothing is measured or the measurement failed."""
        measured = [p for p in prompts if p.measured]
        if not measured:
            return {}
        cap = min(self.memory.images, len(prompts))  # the speculative engine's occupancy in this call
        n = min(len(prompts), -(-len(measured) // cap) * cap)
        todo = measured + [p for p in prompts if not p.measured][: n - len(measured)]
        try:
            results = self.baseline.generate([p.prompt for p in todo], [p.seed for p in todo])
        except Exception as e:  # noqa: BLE001 - the measurement is optional; the images are fine
            if _is_fatal(e):
                self._die(e)
            log.warning("baseline for %d prompts failed: %s", len(measured), _describe(e))
            return {}
        finally:
            self.baseline.release()  # its caches go before the batch's own are made (the memory plan holds one set)
        wave = lambda i: float(min(cap, n - i // cap * cap))  # noqa: E731 - images in flight in item i's wave
        return {p.prompt_id: (res, wave(i)) for i, (p, res) in enumerate(zip(todo, results)) if p.measured}

    def _free_memory(self) -> None:
        import gc

        import torch

        for gen in (self.generator, self.baseline):
            if gen is not None:
                gen.release()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _die(self, err: BaseException) -> None:
        log.error("unrecoverable engine failure, ending this worker: %s", _describe(err))
        if self.in_actor:
            logging.shutdown()
            os._exit(70)  # Ray restarts the actor and retries the batch
        raise WorkerDied(_describe(err)) from err


@dataclass(frozen=True)
class _Prompt:
    prompt_id: str
    prompt: str
    seed: int
    measured: bool  # also decoded with vanilla AR (baseline_fraction)


def _dict_batch_rows(batch: dict) -> list[dict]:
    cols = list(batch)
    n = len(batch[cols[0]]) if cols else 0
    return [{c: (batch[c][i].item() if hasattr(batch[c][i], "item") else batch[c][i]) for c in cols} for i in range(n)]
