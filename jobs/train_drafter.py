"""Train a drafter for a target, on Ray Train, from the target's own images.

    python -m jobs.train_drafter --bundle <dir | manifest | name> --prompts <parquet uri> --out <uri>
    python -m jobs.train_drafter --config jobs/train/recipes/emoji16.yaml --out outputs/train_emoji16
    python -m jobs.train_drafter ... --data <an earlier jobs.generate output>   # reuse its token grids

One validated config (TrainDrafterConfig: defaults < --config file < flags < --set a.b=v;
a flag per field, `--section.field` for nested ones: --train.lr 1e-3, --eval.methods
[eagle2]; `_` or `-`, no abbreviations), saved as OUT/train_config.json. Steps: (1) data: the project's batch job draws the target's
images for the prompts (method ar, the bundle's sampling defaults, token grids kept) into
OUT/data, resumable, unless --data names an earlier output; (2) training: Ray Train workers
(one per GPU, else CPU workers) fit the EAGLE-style head with the frozen target in each step,
checkpointing to OUT/train; (3) evaluation: acceptance length of eagle2 and adt, greedy and at
the bundle's defaults, on held-out prompts; (4) export: OUT/drafter (config.json +
model.safetensors fp16 + provenance.json), OUT/bundle (the bundle with this drafter, for a
bundle directory) and OUT/result.json, written last: without it nothing in OUT is a result.
Run the same command again to resume after a crash or a kill (data, training and export).

Exit codes (docs/training.md): 0 done; 2 a bad flag, config, prompt input or bundle refused (or OUT holds
a run with another config); 3 Ray cluster unreachable or too small; 4 output not writable or
storage unavailable; 6 interrupted; 7 internal error; 8 training data unusable (empty, every
row failed, token ids outside the codebook, another grid); 9 the bundle's model family has no
drafter head type; 10 training failed (workers failed more than train.max_failures times).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

import pyarrow.parquet as pq
import torch
import yaml

from pipeline.cli import CliParser, add_config_flags, config_overrides
from pipeline.config import ConfigError, StorageSettings
from pipeline.storage import Storage, is_remote, open_storage, parse_uri
from pipeline.retry import StorageUnavailable
from jobs.train.heads import HEADS, family_of
from jobs.train.job_config import (CONFIG_FILE, EXIT_BAD_DATA, EXIT_BAD_INPUT, EXIT_CODES, EXIT_INTERNAL,  # noqa: F401
                                   EXIT_INTERRUPTED, EXIT_NO_HEAD, EXIT_NO_RESOURCES, EXIT_OK, EXIT_STORAGE,
                                   EXIT_TRAINING_FAILED, RESULT_FILE, JobError, TrainDrafterConfig, load_config)
from jobs.train.job_export import export

log = logging.getLogger("jobs.train_drafter")

# ---------------------------------------------------------------- helpers


def child_uri(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def absolute(uri: Optional[str]) -> Optional[str]:
    """Local paths made absolute (Ray Train workers run in another directory)."""
    if uri is None or is_remote(uri):
        return uri
    return parse_uri(uri).path


def probe_writable(out: Storage) -> None:
    key = ".write-probe"
    try:
        out.put_text(key, "probe\n")
        out.delete(key)
    except (OSError, StorageUnavailable) as e:
        raise JobError(f"output {out.uri} is not writable: {type(e).__name__}: {e}", EXIT_STORAGE) from None


def check_saved_config(out: Storage, cfg: TrainDrafterConfig) -> None:
    if out.exists(CONFIG_FILE):
        saved = json.loads(out.get_text(CONFIG_FILE))
        if saved.get("config_hash") != cfg.config_hash():
            raise JobError(f"{out.uri_for(CONFIG_FILE)} holds a run with another config ({saved.get('config_hash')} != "
                           f"{cfg.config_hash()}): choose another --out", EXIT_BAD_INPUT)
    out.put_text(CONFIG_FILE, cfg.to_json(), "application/json")


def read_prompt_table(uri: str, storage: StorageSettings, limit: int) -> tuple[list[str], list[int]]:
    from pipeline.prompts import PromptInputError, open_prompts

    try:
        src = open_prompts(uri, storage)
    except PromptInputError as e:
        raise JobError(f"eval.prompts: {e}", EXIT_BAD_INPUT) from None
    cols = ["prompt", "seed"] if src.has_seed else ["prompt"]
    table = pq.read_table(src.paths, filesystem=src.filesystem, columns=cols) if len(src.paths) > 1 else \
        pq.read_table(src.paths[0], filesystem=src.filesystem, columns=cols)
    rows = table.to_pylist()[:limit]
    return [r["prompt"] for r in rows], [int(r.get("seed") or 0) for r in rows]


def plan_workers(cfg: TrainDrafterConfig) -> tuple[int, bool, float]:
    """(workers, use_gpu, cpus per worker) for the cluster Ray is connected to."""
    import ray

    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), float(res.get("CPU", 0))
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0)
    if cfg.device == "cuda" and gpus == 0:
        raise JobError("device cuda: the Ray cluster has no GPU", EXIT_NO_RESOURCES)
    n = cfg.num_workers or (gpus if use_gpu else 2)
    if use_gpu and n > gpus:
        raise JobError(f"{n} GPU workers asked for, the cluster has {gpus} GPU(s)", EXIT_NO_RESOURCES)
    per = cfg.cpus_per_worker or (1.0 if use_gpu else min(1.0, cpus / n))
    if not use_gpu and n * per > cpus + 1e-9:
        raise JobError(f"{n} workers x {per:g} CPU do not fit the cluster's {cpus:g} CPUs", EXIT_NO_RESOURCES)
    if cfg.train.batch_size % n:
        raise JobError(f"train.batch_size {cfg.train.batch_size} is not a multiple of the {n} workers", EXIT_BAD_INPUT)
    return n, use_gpu, per


# ---------------------------------------------------------------- the steps


def make_data(cfg: TrainDrafterConfig, out: Storage, say) -> Storage:
    """The batch job's output holding the token grids (run here unless cfg.data is given)."""
    if cfg.data is not None:
        return open_storage(cfg.data, cfg.storage)
    from pipeline.checks import JobRefused
    from pipeline.driver import run_job
    from pipeline.execute import JobInterrupted
    from pipeline.exit_codes import EXIT_INTERRUPTED as GEN_INTERRUPTED, EXIT_STORAGE_UNAVAILABLE
    from jobs.train.distill import data_job_config

    data_uri = child_uri(cfg.out, "data")
    job = data_job_config(cfg.bundle, cfg.prompts, data_uri, cfg.distill.num_actors, cfg.distill.decode_batch_size,
                          cfg.storage, cfg.ray_address, job_id="distill")
    say(f"data: the target's own images for {cfg.prompts} (ar, the bundle's sampling defaults) -> {data_uri}")
    try:
        result = run_job(job, sys.stdout)
    except JobRefused as e:
        raise JobError(f"data: {e}", getattr(e, "exit_code", EXIT_BAD_INPUT)) from None
    except JobInterrupted as e:
        raise JobError(f"data: {e}", EXIT_INTERRUPTED) from None
    if result.exit_code == GEN_INTERRUPTED:
        raise JobError("data: interrupted; run the same command again to resume", EXIT_INTERRUPTED)
    if result.exit_code == EXIT_STORAGE_UNAVAILABLE:
        raise JobError(f"data: {result.summary.get('error')}", EXIT_STORAGE)
    return open_storage(data_uri, cfg.storage)


FAULT_ENV = "ADT_TRAIN_FAULT"  # tests only (jobs/train/ray_train.py)


def train_loop_config(cfg: TrainDrafterConfig, family: str, train_ref, heldout_ref) -> dict[str, Any]:
    return {"train": cfg.train.model_dump(), "bundle": cfg.bundle, "family": family, "out": cfg.out,
            "storage": cfg.storage.model_dump(),
            "threads_per_worker": cfg.threads_per_worker, "train_ref": train_ref, "heldout_ref": heldout_ref,
            "fault": os.environ.get(FAULT_ENV)}


def fit(cfg: TrainDrafterConfig, out: Storage, family: str, train_ref, heldout_ref, say):
    """Ray Train: TorchTrainer over `n` workers, checkpoints under OUT/<run_name>; the final checkpoint."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from jobs.train.ray_train import train_loop_per_worker

    n, use_gpu, per = plan_workers(cfg)
    say(f"training: {n} {'GPU' if use_gpu else 'CPU'} worker(s) x {cfg.train.batch_size // n} images per step, "
        f"{cfg.train.steps} steps, checkpoints every {cfg.train.ckpt_every} in {out.uri_for(cfg.run_name)}")
    local = parse_uri(cfg.out).scheme == "file"
    run_config = ray.train.RunConfig(
        name=cfg.run_name, storage_path=out.arrow_path(), storage_filesystem=None if local else out.arrow_fs(),
        failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
    )
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=train_loop_config(cfg, family, train_ref, heldout_ref),
        scaling_config=ray.train.ScalingConfig(num_workers=n, use_gpu=use_gpu,
                                               resources_per_worker=None if use_gpu else {"CPU": per}),
        run_config=run_config, torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
    )
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        first = str(e).strip().splitlines()
        raise JobError(f"training failed: {first[0] if first else type(e).__name__}", EXIT_TRAINING_FAILED) from None
    return result.checkpoint, n


def run(cfg: TrainDrafterConfig, say: Callable[[str], None]) -> int:
    from pipeline.cluster import ClusterUnavailable, connect
    from pipeline.worker import load_bundle_spec

    t_job = time.time()
    cfg = cfg.model_copy(update={"out": absolute(cfg.out), "prompts": absolute(cfg.prompts), "data": absolute(cfg.data),
                                 "bundle": cfg.bundle if not os.path.exists(cfg.bundle) else os.path.abspath(cfg.bundle),
                                 "eval": cfg.eval.model_copy(update={"prompts": absolute(cfg.eval.prompts)})})
    try:
        bundle = load_bundle_spec(cfg.bundle, cfg.storage)
    except Exception as e:  # noqa: BLE001 - any load failure is a refused bundle
        raise JobError(f"bundle {cfg.bundle!r} cannot be loaded: {type(e).__name__}: {e}", EXIT_BAD_INPUT) from None
    family = family_of(bundle)
    if family not in HEADS:
        raise JobError(f"bundle {cfg.bundle!r} is a {family} model: no drafter head type for that family "
                       f"(this job trains heads for: {', '.join(sorted(HEADS))})", EXIT_NO_HEAD)
    out = open_storage(cfg.out, cfg.storage)
    probe_writable(out)
    check_saved_config(out, cfg)  # before the finished-output check: another config must not get the old drafter
    if out.exists(RESULT_FILE):
        say(f"{out.uri_for(RESULT_FILE)} exists: this output already holds a finished drafter")
        return EXIT_OK
    say(f"config {cfg.config_hash()} saved to {out.uri_for(CONFIG_FILE)}")

    from jobs.train.distill import data_job_config

    import ray

    started = False
    try:
        started = connect(data_job_config(cfg.bundle, cfg.prompts or cfg.out, cfg.out, 1, 1, cfg.storage,
                                          cfg.ray_address, "connect"), say)
        interrupt_on_sigterm()  # ray.init in the main thread installs its own SIGTERM handler (exit 1, no line)
        return _run_on_ray(cfg, out, bundle, say, t_job)
    except ClusterUnavailable as e:
        raise JobError(str(e), EXIT_NO_RESOURCES) from None
    finally:
        if started:
            ray.shutdown()


def _run_on_ray(cfg: TrainDrafterConfig, out: Storage, bundle, say, t_job: float) -> int:
    import ray

    from jobs.train.distill import DataError, heldout_mask, load_grids, table_of, worker_arrays
    from jobs.train.eval import acceptance, drafter_from_state
    from jobs.train.ray_train import read_state

    data_store = make_data(cfg, out, say)
    family = family_of(bundle)
    num_codes = bundle.make_prompter().vocab.num_codes
    try:
        grids = load_grids(data_store, num_codes, tuple(bundle.grid))
    except DataError as e:
        raise JobError(str(e), EXIT_BAD_DATA) from None
    held = heldout_mask(grids.prompt_ids, cfg.distill.heldout_fraction)
    train_set, heldout_set = grids.subset(~held), grids.subset(held)
    if len(train_set) < cfg.train.batch_size:
        raise JobError(f"{len(train_set)} training grid(s) in {data_store.uri} (after holding out "
                       f"{len(heldout_set)}), fewer than train.batch_size {cfg.train.batch_size}", EXIT_BAD_DATA)
    say(f"data: {len(grids)} grids ({grids.failed} prompt(s) failed, not used): {len(train_set)} train, "
        f"{len(heldout_set)} held out; {len(grids.prompts)} distinct prompts")
    t0 = time.time()
    rows = HEADS[family].prompt_arrays(bundle, grids.prompts, out, say)
    say(f"prompt rows {', '.join(f'{k} {tuple(v.shape)}' for k, v in rows.items())} ({time.time() - t0:.0f} s)")
    train_ref = ray.put(worker_arrays(train_set, rows))
    heldout_ref = ray.put(worker_arrays(heldout_set, rows)) if len(heldout_set) else None

    t_train = time.time()
    checkpoint, workers = fit(cfg, out, family, train_ref, heldout_ref, say)
    state = read_state(checkpoint)
    if state is None or int(state["step"]) != cfg.train.steps:
        raise JobError(f"training ended without a final checkpoint (step {state and state['step']})", EXIT_TRAINING_FAILED)
    train_s = time.time() - t_train
    drafter = drafter_from_state(state, family, bundle.target)
    say(f"trained to step {state['step']} in {train_s / 60:.1f} min on this run")

    evaluation = []
    if cfg.eval.limit:
        if cfg.eval.prompts:
            prompts, seeds = read_prompt_table(cfg.eval.prompts, cfg.storage, cfg.eval.limit)
        else:
            rows = table_of(heldout_set).to_pylist()[:cfg.eval.limit]
            prompts, seeds = [r["prompt"] for r in rows], [r["seed"] for r in rows]
        if prompts:
            if cfg.eval.threads:
                torch.set_num_threads(cfg.eval.threads)
            say(f"evaluation: {', '.join(cfg.eval.methods)} at temperatures {cfg.eval.temperatures} on {len(prompts)} "
                f"held-out prompt(s)")
            show = lambda r: say(f"  {r['method']:7s} T={r['temperature']!s:8s} mean acceptance length "  # noqa: E731
                                 f"{r['mean_acceptance_length']:.3f} ({r['images']} images, {r['seconds']:.0f} s)")
            evaluation = acceptance(bundle, drafter, prompts, seeds, cfg.eval.methods, cfg.eval.temperatures,
                                    cfg.eval.batch_size, max_tokens=cfg.eval.max_tokens, on_record=show)
    last = state["metrics"][-1] if state["metrics"] else {}
    provenance = {
        "job": "jobs.train_drafter", "config": json.loads(cfg.to_json()), "family": family,
        "data": {"uri": data_store.uri, "grids": len(grids), "train": len(train_set), "heldout": len(heldout_set),
                 "failed": grids.failed, "prompts": len(grids.prompts)},
        "training": {"steps": int(state["step"]), "workers": workers, "final_metrics": last,
                     "wall_s_this_run": train_s, "checkpoints": out.uri_for(cfg.run_name)},
        "evaluation": evaluation,
    }
    written = export(cfg, out, bundle, drafter, provenance, family)
    result = {"status": "done", "config_hash": cfg.config_hash(), **written, "metrics": out.uri_for("metrics.jsonl"),
              "steps": int(state["step"]), "evaluation": evaluation, "job_wall_s_this_run": time.time() - t_job}
    out.put_text(RESULT_FILE, json.dumps(result, indent=2, default=str) + "\n", "application/json")
    say(f"done: drafter in {written['drafter']}; {out.uri_for(RESULT_FILE)}")
    return EXIT_OK


# ---------------------------------------------------------------- command line


def build_parser() -> CliParser:
    p = CliParser("python -m jobs.train_drafter", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--config", help="YAML / JSON file of TrainDrafterConfig fields (e.g. jobs/train/recipes/emoji16.yaml).")
    p.add_argument("--print-config", action="store_true", help="Print the resolved config and exit.")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="Any config field by dotted name (YAML value), e.g. --set train.lr=1e-3 (the same as "
                        "--train.lr 1e-3; applied after the flags).")
    add_config_flags(p, TrainDrafterConfig, aliases={"eval.prompts": ["--eval-prompts"], "train.steps": ["--steps"]})
    return p


def overrides_from(args: dict[str, Any]) -> dict[str, Any]:
    out = config_overrides(args, TrainDrafterConfig)
    for item in args["set"]:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: not valid YAML: {e}") from None
    return out


def _interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop, `ray job stop`, a preempted node) ends the job like Ctrl-C:
    one line and exit 6; the checkpoints written so far resume on the next run."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)


def main(argv: Optional[list[str]] = None) -> int:
    previous = signal.getsignal(signal.SIGTERM)
    interrupt_on_sigterm()
    try:
        return _main(argv)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)  # callers in this process (tests) keep theirs


def _main(argv: Optional[list[str]]) -> int:
    args = vars(build_parser().parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args["config"], overrides_from(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if args["print_config"]:
        print(cfg.to_json(), end="")
        return EXIT_OK
    say = lambda msg: print(f"[train_drafter] {msg}", flush=True)  # noqa: E731
    try:
        return run(cfg, say)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.code
    except StorageUnavailable as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_STORAGE
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again to resume", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug: say so with the traceback
        log.exception("internal error")
        print(f"error: internal error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
