"""The distributed training loop: one Ray Train worker per GPU (CPU workers when there are none),
DDP over the drafter (gloo on CPU, nccl on GPU), the frozen target inside every step.

Each worker loads the bundle's target (frozen, fp32) and a fresh drafter of the family's head
type (jobs/train/heads.py: LlamaGen's `build_drafter`, Janus' `new_drafter`), then for step
s = start .. steps - 1 (`train_loop`, which runs without Ray too):

    images   = batch_indices(N, s, batch_size, seed + 1)[rank::world]      # this rank's share
    f, h     = kind.pairs(target, drafter, tokens, prompt rows, noise)      # one teacher-forced target
                                                                            # forward, both CFG rows
    loss     = SmoothL1(f, h) + ce_weight * CE(softmax(head(h)), log_softmax(head(f)))

(f: the drafter's output for (token p, h_{p-1} + U(-noise, noise)); h: the target's h_p.)
Batches and noise are functions of the step and the rank alone, so a run resumed from a
checkpoint takes the steps an uninterrupted run takes.

Checkpoints (every `ckpt_every` steps and at the last step) go to Ray Train's storage under the
output (RunConfig storage_path / name, a pyarrow filesystem for s3://): `state.pt` (drafter,
optimizer, step, metrics so far; torch.load(weights_only=True)). A worker that dies restarts
the worker group from the latest checkpoint (FailureConfig.max_failures); a driver started
again with the same output resumes the run from Ray Train's snapshot of its checkpoints.
Rank 0 rewrites `metrics.jsonl` beside them at every log line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jobs.train.drafter import losses
from jobs.train.heads import HEADS
from jobs.train.target import adamw, autocast, lr_at
from jobs.train.tokenizer import batch_indices

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"
RESUMED_FILE = "resumed.json"  # the step the last resumed run started from (rank 0)
FAULT_ENV = "ADT_TRAIN_FAULT"  # tests only, read by the driver: "kill:<rank>:<step>:<marker file>" or "delay:<s>"


def _fault(spec: str, rank: int, step: int) -> None:
    """Test-only fault switch (see FAULT_ENV): SIGKILL this worker once at a step, or slow every step."""
    if spec.startswith("delay:"):
        time.sleep(float(spec.split(":")[1]))
    elif spec.startswith("kill:"):
        _, r, s, marker = spec.split(":", 3)
        if int(r) == rank and int(s) == step:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)


class Shard:
    """The training grids as tensors: tokens (N, L), prompt index (N,), and the head type's
    per-prompt arrays (LlamaGen: caption states (P, T, C) and masks (P, T); a token family: its
    CFG id rows, jobs/train/token_pairs.py), indexed by prompt."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        # copies: the object store's arrays are read-only
        self.tokens = torch.tensor(np.asarray(arrays["tokens"]), dtype=torch.long)
        self.prompt = torch.tensor(np.asarray(arrays["prompt"]), dtype=torch.long)
        self.rows = {k: torch.tensor(np.asarray(v)) for k, v in arrays.items() if k not in ("tokens", "prompt")}

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, images: torch.Tensor, device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """images (B,) -> tokens (B, L) and each per-prompt array at the images' prompts (B, ...)."""
        idx = self.prompt[images]
        return self.tokens[images].to(device), {k: v[idx].to(device) for k, v in self.rows.items()}


def _load_state(checkpoint) -> dict | None:
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        return torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True)


def read_state(checkpoint) -> dict | None:
    """A checkpoint's state dict (drafter, optimizer, step, metrics), or None."""
    return _load_state(checkpoint)


def _save_and_report(metrics: dict, state: dict | None) -> None:
    """ray.train.report on every rank (a collective); rank 0 attaches the checkpoint."""
    import ray.train

    if state is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as d:
        torch.save(state, Path(d) / STATE_FILE)
        (Path(d) / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in state["metrics"]))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def _mean_across(values: dict[str, float], world: int) -> dict[str, float]:
    if world == 1:
        return values
    import torch.distributed as dist

    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / world for k, v in zip(keys, t.tolist())}


@torch.no_grad()
def agreement(kind, target, drafter, data: Shard, device, amp: str, batch_size: int = 16) -> dict[str, float]:
    """Top-1 agreement of head(f) with head(h) and feature smooth-L1 on held-out grids (no noise)."""
    drafter.eval()
    sums = {"heldout_agree_cond": 0.0, "heldout_agree_uncond": 0.0, "heldout_smooth_l1": 0.0}
    n = 0
    for i in range(0, len(data), batch_size):
        tokens, rows = data.batch(torch.arange(i, min(i + batch_size, len(data))), device)
        f, h = kind.pairs(target, drafter, tokens, rows, device, amp, 0.0, None)
        head = kind.head(target)
        same = head(f.float()).argmax(-1) == head(h).argmax(-1)  # (2B, n)
        b = tokens.shape[0]
        sums["heldout_agree_cond"] += same[:b].float().sum().item() / same.shape[1]
        sums["heldout_agree_uncond"] += same[b:].float().sum().item() / same.shape[1]
        sums["heldout_smooth_l1"] += torch.nn.functional.smooth_l1_loss(f.float(), h).item() * b
        n += b
    drafter.train()
    return {k: v / max(n, 1) for k, v in sums.items()}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train worker function; `config` is built by jobs.train_drafter.train_loop_config."""
    import ray
    import ray.train
    import ray.train.torch

    from pipeline.config import StorageSettings
    from pipeline.storage import open_storage
    from pipeline.worker import load_bundle_spec

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(int(config["threads_per_worker"]))
    train = Shard(ray.get(config["train_ref"]))
    heldout = Shard(ray.get(config["heldout_ref"])) if config.get("heldout_ref") is not None else None
    storage = StorageSettings.model_validate(config["storage"])
    bundle = load_bundle_spec(config["bundle"], storage)
    out = open_storage(config["out"], storage) if rank == 0 else None
    state = read_state(ray.train.get_checkpoint())
    if state is not None and rank == 0:
        print(f"[train] resuming at step {int(state['step'])} from the latest checkpoint", flush=True)
        # the printed line reaches the driver's log only if Ray forwards it before the run ends
        out.put_text(RESUMED_FILE, json.dumps({"step": int(state["step"])}) + "\n", "application/json")
    train_loop(config, bundle.target, train, heldout, ray.train.torch.get_device(), rank, world, state,
               _save_and_report, out, prepare=ray.train.torch.prepare_model if world > 1 else None)


def train_loop(config: dict[str, Any], target, train: Shard, heldout: Shard | None, device, rank: int = 0,
               world: int = 1, state: dict | None = None, report=None, out=None, prepare=None) -> dict:
    """The training steps of one worker, without Ray: the frozen target, a fresh drafter of the
    family's head type (or `state`'s, to resume), steps state.step .. train.steps - 1. At each
    log / checkpoint step `report(metrics, state | None)` is called (Ray Train's report on a
    worker; any callable in process), rank 0 writes metrics.jsonl to `out` when given.
    `prepare` wraps the drafter for DDP. Returns the last state (rank 0's checkpoint content)."""
    tc = config["train"]
    amp = tc["amp"]
    target = target.float().to(device).eval().requires_grad_(False)
    torch.manual_seed(tc["seed"])  # every rank builds the same initial drafter
    kind = HEADS[config["family"]]
    drafter = kind.build(target, tc["ffn_dim"]).to(device).train()
    opt = adamw(drafter, tc["lr"], tc["weight_decay"])
    step, history = 0, []
    if state is not None:
        drafter.load_state_dict(state["model"], strict=True)
        opt.load_state_dict(state["optimizer"])
        step, history = int(state["step"]), list(state["metrics"])
    model = prepare(drafter) if prepare is not None else drafter

    steps, bs = tc["steps"], tc["batch_size"]
    window: list[dict[str, float]] = []
    t_log, s_log = time.time(), step
    while step < steps:
        if config.get("fault"):
            _fault(config["fault"], rank, step)
        images = batch_indices(len(train), step, bs, tc["seed"] + 1)[rank::world]
        tokens, rows = train.batch(images, device)
        g = torch.Generator().manual_seed(tc["seed"] * 7919 + step * world + rank)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, tc["lr"], tc["warmup"], tc["final_lr_frac"])
        f, h = kind.pairs(target, model, tokens, rows, device, amp, tc["noise"], g)
        parts = losses(kind.head(target), f, h, tc["ce_weight"])
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        grad_norm = nn.utils.clip_grad_norm_(drafter.parameters(), tc["grad_clip"])
        opt.step()
        window.append({k: v.item() for k, v in parts.items()} | {"grad_norm": float(grad_norm)})
        step += 1
        last = step == steps
        log_now = step % tc["log_every"] == 0 or last
        ckpt_now = step % tc["ckpt_every"] == 0 or last
        if not (log_now or ckpt_now):
            continue
        record: dict[str, Any] = {"step": step}
        if window:
            means = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
            now = time.time()
            record |= _mean_across(means, world)
            record |= {"lr": lr_at(step - 1, steps, tc["lr"], tc["warmup"], tc["final_lr_frac"]),
                       "steps_per_s": (step - s_log) / max(now - t_log, 1e-9), "time": now, "workers": world}
            window, t_log, s_log = [], now, step
        if rank == 0 and heldout is not None and len(heldout) and tc["eval_every"] and \
                (step % tc["eval_every"] == 0 or last):
            record |= agreement(kind, target, drafter, heldout, device, amp)
        if rank == 0:
            history.append(record)
            if out is not None:
                out.put_text(METRICS_FILE, "".join(json.dumps(r) + "\n" for r in history), "application/x-ndjson")
        state = None
        if ckpt_now and rank == 0:
            state = {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                     "metrics": history, "drafter_config": kind.config_dict(drafter)}
        if report is not None:
            report({k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}, state)
    return {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step, "metrics": history,
            "drafter_config": kind.config_dict(drafter)}
