"""Train a small LlamaGen-style VQ tokenizer on the 64x64 emoji set (CPU, one thread).

    python -m jobs.train.tokenizer --data data/emoji --out runs/tokenizer [--steps N] [--resume]
    python -m jobs.train.tokenizer --out runs/tokenizer --export-only [--export DIR]

Loss = MSE + L1 on pixels in [-1, 1] + the quantiser's codebook and commitment losses.
No flips or rotations (emoji have an orientation); optional small shifts on a white canvas.
Codes unused for a while are restarted on random encoder latents of the current batch.

Files in OUT: ckpt.pt (model, optimizer, step; saved every few minutes, at the end and on SIGTERM;
load with weights_only=True), metrics.jsonl (one JSON object per log line), and at the end
the exported tokenizer in --export (default OUT/final): config.json + model.safetensors
(fp16) + train_info.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from adt_core.families.vqgan import VQConfig, VQModel, count_parameters, save_pretrained

# 64 px -> 16x16 tokens (f = 4); ~1.1M parameters; ~2 s per batch of 16 on one CPU thread.
DEFAULT_CONFIG = VQConfig(codebook_size=1024, codebook_embed_dim=8, z_channels=64, ch=32,
                          ch_mult=(1, 2, 2), num_res_blocks=1)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000  # total optimisation steps (~1.8 h at batch 16 on one free thread)
    batch_size: int = 16
    lr: float = 1e-3  # AdamW peak; cosine decay to lr * final_lr_frac
    final_lr_frac: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.0  # codebook and norms are tiny; no decay needed
    l1_weight: float = 1.0  # pixel loss = MSE + l1_weight * L1
    vq_weight: float = 1.0  # weight of codebook + commitment losses
    max_shift: int = 2  # random translation in pixels (white fill); 0 = no augmentation
    restart_every: int = 50  # steps between dead-code restarts (0 = never)
    eval_every: int = 100  # steps between held-out evaluations
    log_every: int = 10
    ckpt_minutes: float = 5.0
    seed: int = 0


# ---------------------------------------------------------------- data


def load_images(data: Path, split: str) -> torch.Tensor:
    """uint8 (N, 64, 64, 3) from DATA/{split}_images.npy."""
    return torch.from_numpy(np.load(data / f"{split}_images.npy"))


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float (B, 3, H, W) in [-1, 1]."""
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def batch_indices(n: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Deterministic epoch-wise shuffling, so a resumed run sees the same batches."""
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)[k * batch_size:(k + 1) * batch_size]


def shift_white(x: torch.Tensor, max_shift: int, g: torch.Generator) -> torch.Tensor:
    """Translate each image by up to max_shift pixels, filling with white (1.0)."""
    if max_shift <= 0:
        return x
    b, _, h, w = x.shape
    padded = F.pad(x, [max_shift] * 4, value=1.0)  # (B, 3, H + 2s, W + 2s)
    offs = torch.randint(0, 2 * max_shift + 1, (b, 2), generator=g)
    return torch.stack([padded[i, :, dy:dy + h, dx:dx + w]
                        for i, (dy, dx) in enumerate(offs.tolist())])


# ---------------------------------------------------------------- training pieces


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.lr * (tc.final_lr_frac + (1 - tc.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def train_step(model: VQModel, opt: torch.optim.Optimizer, x: torch.Tensor,
               tc: TrainConfig) -> dict[str, float]:
    """One optimisation step on x (B, 3, H, W) in [-1, 1]; returns scalar losses."""
    recon, vq = model(x)
    mse = F.mse_loss(recon, x)
    l1 = F.l1_loss(recon, x)
    vq_loss = vq["codebook"] + vq["commit"] + vq.get("entropy", 0.0)
    loss = mse + tc.l1_weight * l1 + tc.vq_weight * vq_loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {"loss": loss.item(), "mse": mse.item(), "l1": l1.item(), "vq": vq_loss.item(),
            "usage_window": float(vq["usage"])}


@torch.no_grad()
def restart_dead_codes(model: VQModel, x: torch.Tensor, g: torch.Generator) -> int:
    """Point codes absent from the usage window at random current latents; returns count."""
    q = model.quantize
    used = torch.zeros(q.cfg.codebook_size, dtype=torch.bool)
    used[q.codebook_used.long().clamp(0, q.cfg.codebook_size - 1)] = True
    dead = (~used).nonzero().flatten()
    if dead.numel() == 0:
        return 0
    model.eval()
    z = model.encode_latents(x)  # (B, e, h, w)
    model.train()
    flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]), dim=-1)  # (N, e)
    pick = torch.randint(0, flat.shape[0], (dead.numel(),), generator=g)
    q.embedding.weight[dead] = flat[pick] + 0.01 * torch.randn(
        dead.numel(), flat.shape[1], generator=g)
    return int(dead.numel())


@torch.no_grad()
def evaluate(model: VQModel, images: torch.Tensor, batch_size: int = 64) -> dict[str, float]:
    """Held-out reconstruction: PSNR (pooled MSE and mean per image) and code usage."""
    model.eval()
    sq_err, codes_seen = [], set()
    for i in range(0, len(images), batch_size):
        batch = images[i:i + batch_size]  # uint8 (b, 64, 64, 3)
        codes = model.encode(batch)
        recon = model.decode(codes)
        sq_err.append((recon.float() - batch.float()).pow(2).flatten(1).mean(1))  # (b,)
        codes_seen.update(codes.unique().tolist())
    model.train()
    mse = torch.cat(sq_err)
    return {"heldout_psnr": float(10 * torch.log10(255.0 ** 2 / mse.mean())),
            "heldout_psnr_mean_img": float((10 * torch.log10(255.0 ** 2 / mse.clamp_min(1e-3))).mean()),
            "heldout_codes_used": len(codes_seen),
            "codebook_usage": len(codes_seen) / model.cfg.codebook_size}


# ---------------------------------------------------------------- checkpoints


def save_checkpoint(path: Path, model: VQModel, opt: torch.optim.Optimizer, step: int,
                    tc: TrainConfig) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "vq_config": model.cfg.to_dict(), "train_config": vars_of(tc)}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def vars_of(tc: TrainConfig) -> dict:
    return {k: getattr(tc, k) for k in tc.__dataclass_fields__}


def export(model: VQModel, directory: Path, info: dict) -> None:
    save_pretrained(model, directory, dtype=torch.float16)
    (directory / "train_info.json").write_text(json.dumps(info, indent=2))


# ---------------------------------------------------------------- main loop


class CheckpointClock:
    """When a training loop saves: every `minutes`, at the last step, and on SIGTERM / SIGINT,
    after which the loop stops (the run resumes from that checkpoint)."""

    def __init__(self, minutes: float, save) -> None:
        self.minutes, self.save, self.last, self.stop = minutes, save, time.time(), False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum, frame) -> None:
        self.stop = True

    def tick(self, step: int, last_step: bool) -> bool:
        """Save if due; True when the loop must stop now."""
        if time.time() - self.last > self.minutes * 60 or last_step or self.stop:
            self.save(step)
            self.last = time.time()
        if self.stop:
            print(f"stopped by signal at step {step}; checkpoint saved", flush=True)
        return self.stop


def restore(ckpt: dict | None, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load a resumed run's weights and, when kept, its optimizer moments; returns its step (0 = new)."""
    if not ckpt:
        return 0
    model.load_state_dict(ckpt["model"], strict=True)
    if ckpt.get("optimizer"):  # None after `snapshot restore`: fresh moments
        opt.load_state_dict(ckpt["optimizer"])
    return int(ckpt["step"])


class Logger:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in record.items()), flush=True)


def build_state(args, tc: TrainConfig) -> tuple[VQModel, torch.optim.Optimizer, int]:
    ckpt_path = args.out / "ckpt.pt"
    if args.export_only and not ckpt_path.exists():
        raise FileNotFoundError(f"--export-only needs a checkpoint at {ckpt_path}")
    use_ckpt = (args.resume or args.export_only) and ckpt_path.exists()
    ckpt = load_checkpoint(ckpt_path) if use_ckpt else None
    cfg = VQConfig.from_dict(ckpt["vq_config"]) if ckpt else DEFAULT_CONFIG
    torch.manual_seed(tc.seed)
    model = VQModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(0.9, 0.99),
                            weight_decay=tc.weight_decay)
    return model, opt, restore(ckpt, model, opt)


def freeze_codes(model: VQModel, out: Path) -> None:
    """Fix the image -> token mapping (encoder, quant_conv, codebook); only the decoder keeps
    training. Tokens made from the export in OUT/codes then stay valid for the final tokenizer,
    so the target can train on them while the decoder is still being refined."""
    for m in (model.encoder, model.quant_conv, model.quantize):
        for p in m.parameters():
            p.requires_grad_(False)
    codes_dir = out / "codes"
    if not (codes_dir / "model.safetensors").exists():
        export(model, codes_dir, {"note": "encoder and codebook frozen from here on; decoder still training"})
        print(f"codes frozen; tokenizer for tokenizing exported to {codes_dir}", flush=True)


def run(args) -> None:
    torch.set_num_threads(args.threads)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     eval_every=args.eval_every, max_shift=args.max_shift)
    args.out.mkdir(parents=True, exist_ok=True)
    export_dir = args.export or args.out / "final"
    model, opt, step = build_state(args, tc)
    log = Logger(args.out / "metrics.jsonl")
    heldout = load_images(args.data, "heldout")
    if args.export_only:
        export(model, export_dir, {"step": step, **evaluate(model, heldout)})
        print(f"exported step {step} to {export_dir}")
        return
    train = load_images(args.data, "train")
    print(f"params={count_parameters(model)} config={model.cfg.to_dict()} start_step={step} "
          f"train={len(train)} heldout={len(heldout)}", flush=True)
    if step == 0:
        log({"step": 0, **evaluate(model, heldout), "params": count_parameters(model)})
    t0, t_log, s_log = time.time(), time.time(), step
    clock = CheckpointClock(tc.ckpt_minutes, lambda s: save_checkpoint(args.out / "ckpt.pt", model, opt, s, tc))
    frozen = args.freeze_codes_at is not None and step >= args.freeze_codes_at
    if frozen:
        freeze_codes(model, args.out)
    while step < tc.steps:
        if not frozen and args.freeze_codes_at is not None and step >= args.freeze_codes_at:
            frozen = True
            freeze_codes(model, args.out)
        g = torch.Generator().manual_seed(tc.seed * 7919 + step)
        x = shift_white(to_float(train[batch_indices(len(train), step, tc.batch_size, tc.seed)]),
                        tc.max_shift, g)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        stats = train_step(model, opt, x, tc)
        step += 1
        if tc.restart_every and step % tc.restart_every == 0 and step < 0.8 * tc.steps and not frozen:
            stats["restarted"] = restart_dead_codes(model, x, g)
        if step % tc.log_every == 0 or step == tc.steps:
            now = time.time()
            stats.update(steps_per_s=(step - s_log) / (now - t_log), lr=lr_at(step - 1, tc),
                         elapsed_min=(now - t0) / 60)
            t_log, s_log = now, step
            if step % tc.eval_every == 0 or step == tc.steps:
                stats.update(evaluate(model, heldout))
            log({"step": step, **stats})
        if clock.tick(step, step == tc.steps):
            return
    final = evaluate(model, heldout)
    export(model, export_dir, {"step": step, "params": count_parameters(model), **final,
                               "data": str(args.data)})
    print(f"done step={step} heldout_psnr={final['heldout_psnr']:.2f} exported to {export_dir}",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data/emoji"))
    p.add_argument("--out", type=Path, default=Path("runs/tokenizer"))
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    p.add_argument("--max-shift", type=int, default=TrainConfig.max_shift)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt if present")
    p.add_argument("--export", type=Path, default=None, help="export dir (default OUT/final)")
    p.add_argument("--export-only", action="store_true",
                   help="export the checkpoint in OUT and exit")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--freeze-codes-at", type=int, default=None, metavar="STEP",
                   help="from this step on train only the decoder; the tokenizer for tokenizing the "
                        "dataset is exported to OUT/codes at that step")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
