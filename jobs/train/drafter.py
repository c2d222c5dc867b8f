"""Train the EAGLE draft head on the frozen embedded target.

    python -m jobs.train.drafter --data data/emoji --target runs/target --out runs/drafter \
        --resume --threads 1

Each step: a batch of training images with one caption each. The frozen target (no grad,
autocast as in jobs.train.target) runs teacher-forced on the cond rows (the captions) AND the
uncond rows (`uncond_embedding`, same caption mask), because at generation time the drafter
drafts for both CFG rows. With h_p the target's post-norm hidden state at sequence position p
(caption positions 0 .. T-1, image token i at T + i), the drafter gets, for every
p = T .. T + L - 2, the pair (image token at p, h_{p-1} + uniform noise) at RoPE position p,
under a causal mask over the pairs only (the engine's drafter cache holds no caption pairs:
caption_pairs=False), and outputs f_p. (The pair at p = T + L - 1 is left out: h_{T+L-1} would
predict a token past the grid, and the causal mask means it changes no other output.)

    loss = SmoothL1(f_p, h_p) + 0.1 * CE(softmax(head(h_p)), log_softmax(head(f_p)))

with head = the target's output layer (frozen). The drafter's token embedding starts as a copy
of the target's and stays frozen (EAGLE). Held-out metric: top-1 agreement of head(f_p) with
head(h_p) per CFG row, and of the CFG-mixed argmax at --cfg-scale.

Files in OUT: ckpt.pt (drafter, optimizer, step, configs; resumable like the target's),
metrics.jsonl, train_info.json at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from adt_core.families.llamagen.drafter import Drafter, DrafterConfig
from adt_core.families.llamagen.model import LlamaGenGPT
from adt_core.round.sampling import cfg_mix
from jobs.train.target import (TokenData, adamw, add_run_args, autocast, count_parameters, init_weights,
                               load_checkpoint, load_target, lr_at, pick_device, save_checkpoint,
                               teacher_forced)
from jobs.train.tokenizer import CheckpointClock, Logger, batch_indices, restore


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500  # ~1.4 h at 0.3 steps/s (batch 8, 256 x 6 target, 1 thread)
    batch_size: int = 8  # images per step; the drafter sees 2x as many rows (cond + uncond)
    lr: float = 6e-4  # AdamW peak; warmup then cosine decay to lr * final_lr_frac
    final_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    noise: float = 0.1  # half-width of the uniform noise on input hidden states (EAGLE: U(-0.1, 0.1))
    ce_weight: float = 0.1  # weight of the soft cross-entropy against the target's distribution
    cfg_scale: float = 3.0  # for the CFG-mixed agreement metric only
    eval_every: int = 250
    eval_images: int = 64
    log_every: int = 10
    ckpt_minutes: float = 5.0
    seed: int = 0


# ---------------------------------------------------------------- one batch


@torch.no_grad()
def target_states(target: LlamaGenGPT, tokens: torch.Tensor, captions: torch.Tensor,
                  cmask: torch.Tensor, device, amp: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cond rows then uncond rows: tokens (2B, L) and hidden (2B, T + L - 1, dim) fp32."""
    uncond = target.cls_embedding.uncond_embedding.to(captions.dtype)  # (T, C)
    rows = torch.cat([captions, uncond.expand_as(captions)])
    rmask = torch.cat([cmask, cmask])
    tok = tokens.repeat(2, 1)
    with autocast(device, amp):
        _, hidden = teacher_forced(target, tok, rows, rmask)
    return tok, hidden.float()


def drafter_outputs(drafter: Drafter, tokens: torch.Tensor, hidden: torch.Tensor, t: int,
                    noise: float, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (R, L), hidden (R, T + L - 1, dim) -> (features f (R, L-1, dim), targets h (R, L-1, dim)).

    f[:, j] is the drafter's output for the pair (token j, h_{T+j-1}) at position T + j and
    regresses h[:, j] = h_{T+j}.
    """
    n = tokens.shape[1] - 1
    h_in = hidden[:, t - 1:t - 1 + n]  # (R, L-1, dim) h_{p-1}
    h_out = hidden[:, t:t + n]  # (R, L-1, dim) h_p
    if noise > 0:
        u = torch.rand(h_in.shape, generator=g).to(h_in.device)
        h_in = h_in + (2 * u - 1) * noise
    positions = torch.arange(t, t + n, device=tokens.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()[None, None]
    f = drafter(tokens[:, :n], h_in, positions, causal)
    return f, h_out


def losses(head, f: torch.Tensor, h: torch.Tensor, ce_weight: float) -> dict[str, torch.Tensor]:
    """SmoothL1 feature regression + soft cross-entropy to the target's next-token distribution."""
    reg = F.smooth_l1_loss(f.float(), h)
    with torch.no_grad():
        p = head(h).softmax(-1)  # (R, n, V) target distribution
    logq = head(f.float()).log_softmax(-1)  # (R, n, V) draft distribution (gradient flows through f only)
    ce = -(p * logq).sum(-1).mean()
    agree = (logq.argmax(-1) == p.argmax(-1)).float().mean()
    return {"loss": reg + ce_weight * ce, "smooth_l1": reg, "soft_ce": ce, "top1_agree": agree}


def build_drafter(target: LlamaGenGPT, ffn_dim: int | None = None) -> Drafter:
    """A drafter for `target`; ffn_dim None = the target's FFN width. A narrower FFN makes every
    draft level cheaper where forwards are bound by weight reads (CPUs)."""
    cfg = DrafterConfig.for_target(target.config)
    if ffn_dim:
        cfg = dataclasses.replace(cfg, ffn_dim=ffn_dim)
    drafter = Drafter(cfg)
    init_weights(drafter)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.tok_embeddings.weight)
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(target: LlamaGenGPT, drafter: Drafter, data: TokenData, tc: TrainConfig, device,
             amp: str, batch_size: int = 16) -> dict[str, float]:
    """Top-1 agreement of head(f) with head(h) on held-out images (first caption each, no noise)."""
    drafter.eval()
    t = data.caption_shape[0]
    sums = {"agree_cond": 0.0, "agree_uncond": 0.0, "agree_cfg": 0.0, "smooth_l1": 0.0}
    batches = 0
    images = torch.arange(min(tc.eval_images, len(data)))
    for i in range(0, len(images), batch_size):
        tokens, captions, cmask = data.batch(images[i:i + batch_size], None, device)
        tok, hidden = target_states(target, tokens, captions, cmask, device, amp)
        with autocast(device, amp):
            f, h = drafter_outputs(drafter, tok, hidden, t, 0.0, None)
        q, p = target.head(f.float()), target.head(h)  # (2B, n, V)
        b = tokens.shape[0]
        same = q.argmax(-1) == p.argmax(-1)  # (2B, n)
        sums["agree_cond"] += same[:b].float().mean().item()
        sums["agree_uncond"] += same[b:].float().mean().item()
        mixed = cfg_mix(q, tc.cfg_scale).argmax(-1) == cfg_mix(p, tc.cfg_scale).argmax(-1)  # (B, n)
        sums["agree_cfg"] += mixed.float().mean().item()
        sums["smooth_l1"] += F.smooth_l1_loss(f.float(), h).item()
        batches += 1
    drafter.train()
    return {f"heldout_{k}": v / batches for k, v in sums.items()}


# ---------------------------------------------------------------- main loop


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                     noise=args.noise, ce_weight=args.ce_weight, cfg_scale=args.cfg_scale,
                     eval_every=args.eval_every, eval_images=args.eval_images,
                     ckpt_minutes=args.ckpt_minutes, log_every=args.log_every, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train, heldout = TokenData(args.data, "train"), TokenData(args.data, "heldout")
    target = load_target(args.target).to(device)
    target.requires_grad_(False)
    torch.manual_seed(tc.seed)
    ckpt_path = args.out / "ckpt.pt"
    ckpt = load_checkpoint(ckpt_path) if args.resume and ckpt_path.exists() else None
    ffn_dim = ckpt["drafter_config"]["ffn_dim"] if ckpt else args.ffn_dim  # a resumed run keeps its shape
    drafter = build_drafter(target, ffn_dim).to(device).train()
    opt = adamw(drafter, tc.lr, tc.weight_decay)
    step = restore(ckpt, drafter, opt)
    t = train.caption_shape[0]
    log = Logger(args.out / "metrics.jsonl")
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    print(f"drafter params={count_parameters(drafter)} trainable={trainable} "
          f"config={drafter.config.to_dict()} train_config={asdict(tc)} start_step={step} "
          f"device={device} amp={args.amp}", flush=True)

    def save(step: int) -> None:
        save_checkpoint(ckpt_path, model=drafter.state_dict(), optimizer=opt.state_dict(), step=step,
                        drafter_config=drafter.config.to_dict(), train_config=asdict(tc),
                        target=str(args.target), data=str(args.data))

    if step == 0 and tc.eval_every:
        log({"step": 0, **evaluate(target, drafter, heldout, tc, device, args.amp)})
    clock = CheckpointClock(tc.ckpt_minutes, save)
    t0, t_log, s_log = time.time(), time.time(), step
    window: list[dict[str, float]] = []
    while step < tc.steps:
        g = torch.Generator().manual_seed(tc.seed * 7919 + step)
        images = batch_indices(len(train), step, tc.batch_size, tc.seed + 1)
        tokens, captions, cmask = train.batch(images, g, device)
        tok, hidden = target_states(target, tokens, captions, cmask, device, args.amp)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc.steps, tc.lr, tc.warmup, tc.final_lr_frac)
        with autocast(device, args.amp):
            f, h = drafter_outputs(drafter, tok, hidden, t, tc.noise, g)
        out = losses(target.head, f, h, tc.ce_weight)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
        opt.step()
        window.append({k: v.item() for k, v in out.items()})
        step += 1
        if step % tc.log_every == 0 or step == tc.steps:
            now = time.time()
            rec = {"step": step, **{k: float(np.mean([w[k] for w in window])) for k in window[0]},
                   "lr": lr_at(step - 1, tc.steps, tc.lr, tc.warmup, tc.final_lr_frac),
                   "steps_per_s": (step - s_log) / (now - t_log), "elapsed_min": (now - t0) / 60}
            window, t_log, s_log = [], now, step
            if tc.eval_every and (step % tc.eval_every == 0 or step == tc.steps):
                rec.update(evaluate(target, drafter, heldout, tc, device, args.amp))
            log(rec)
        if clock.tick(step, step == tc.steps):
            return {"step": step, "stopped": True}
    info = {"step": step, "params": count_parameters(drafter), "config": drafter.config.to_dict(),
            **(evaluate(target, drafter, heldout, tc, device, args.amp) if tc.eval_every else {})}
    (args.out / "train_info.json").write_text(json.dumps(info, indent=2))
    print(f"done {json.dumps(info)}", flush=True)
    return info


def load_drafter(path: Path) -> Drafter:
    """A trained drafter from a run dir (RUN/ckpt.pt) or a checkpoint file, in eval mode."""
    ckpt = load_checkpoint(path / "ckpt.pt" if path.is_dir() else path)
    drafter = Drafter(DrafterConfig(**ckpt["drafter_config"]))
    drafter.load_state_dict(ckpt["model"], strict=True)
    return drafter.eval()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data/emoji"))
    p.add_argument("--target", type=Path, default=Path("runs/target"),
                   help="target run dir (ckpt.pt) or checkpoint file")
    p.add_argument("--out", type=Path, default=Path("runs/drafter"))
    p.add_argument("--ffn-dim", type=int, default=None,
                   help="drafter FFN width (default: the target's; only for a new run)")
    p.add_argument("--noise", type=float, default=TrainConfig.noise)
    p.add_argument("--ce-weight", type=float, default=TrainConfig.ce_weight)
    p.add_argument("--cfg-scale", type=float, default=TrainConfig.cfg_scale)
    add_run_args(p, TrainConfig)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
