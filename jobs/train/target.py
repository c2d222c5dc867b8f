"""Train the embedded text-to-image target (LlamaGen GPT, small config) on the tokenized emoji set.

    python -m jobs.train.tokenize --data data/emoji --tokenizer runs/tokenizer/final
    python -m jobs.train.target --data data/emoji --tokenizer runs/tokenizer/final \
        --out runs/target --resume --threads 1

Each step: a batch of training images (deterministic epoch-wise shuffle, so a resumed run sees
the same batches), one caption drawn per image, 10% of captions replaced by the model's
`uncond_embedding` (the caption mask is kept, as the engine does for the uncond row), then one
full teacher-forced forward over [T caption rows, image tokens 0 .. L-2] under the engine's mask
(causal; padded caption keys hidden from every query; each query sees itself) and cross-entropy
of the outputs at positions T-1 .. T+L-2 against image tokens 0 .. L-1.

Mixed precision (--amp): bf16 autocast on CUDA, and on CPUs with native bf16 (avx512_bf16 /
amx_bf16); elsewhere fp32 (on this AVX2-only EPYC a bf16-autocast linear runs at ~4 GFLOPS
against ~17-33 GFLOPS in fp32 on one thread). On a shared CPU use --threads 1: with other
jobs running, two OpenMP threads were 3-6x slower per step than one.

Files in OUT: ckpt.pt (model, optimizer, step, configs; every few minutes, at the end and on
SIGTERM / SIGINT; load with weights_only=True), metrics.jsonl (train loss per log line,
held-out and train-subset per-token NLL every --eval-every steps), train_info.json at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from adt_core.families.llamagen.model import GPTConfig, LlamaGenGPT
from jobs.train.tokenizer import CheckpointClock, Logger, batch_indices, restore


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500  # ~1.9 h at 0.22 steps/s (dim 256 x 6 layers, 1 thread, shared 2-core CPU)
    batch_size: int = 16  # images per step (one caption each)
    lr: float = 1e-3  # AdamW peak; linear warmup, cosine decay to lr * final_lr_frac
    final_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.05  # on matrices and embeddings only, not norms
    grad_clip: float = 1.0
    caption_dropout: float = 0.1  # captions replaced by uncond_embedding (classifier-free guidance)
    eval_every: int = 250  # steps between held-out NLL evaluations
    eval_images: int = 256  # images per evaluation (held-out: all up to this many)
    log_every: int = 10
    ckpt_minutes: float = 5.0
    seed: int = 0


# ---------------------------------------------------------------- data


class TokenData:
    """One split: image token sequences and the precomputed states of every caption.

    tokens (N, L) long; states (M, T, C) fp16; masks (M, T) bool; captions of image i are
    rows first[i] .. first[i] + count[i] - 1 of states/masks (sorted by image).
    """

    def __init__(self, data: Path, split: str) -> None:
        tok = np.load(data / f"tokens_{split}.npy")  # (N, H, W) int16
        self.grid = tuple(int(s) for s in tok.shape[1:])
        self.tokens = torch.from_numpy(tok.reshape(len(tok), -1).astype(np.int64))  # (N, L)
        caps = np.load(data / f"captions_{split}.npz")
        order = np.argsort(caps["image"], kind="stable")
        image = caps["image"][order]
        self.states = torch.from_numpy(caps["states"][order])  # (M, T, C) fp16
        self.masks = torch.from_numpy(caps["masks"][order])  # (M, T) bool
        if len(image) and image.max() >= len(tok):
            raise ValueError(f"{split}: captions refer to image {image.max()} of {len(tok)}")
        count = np.bincount(image, minlength=len(tok))
        if (count == 0).any():
            raise ValueError(f"{split}: {(count == 0).sum()} images have no caption")
        self.count = torch.from_numpy(count)  # (N,)
        self.first = torch.from_numpy(np.concatenate([[0], np.cumsum(count)[:-1]]))  # (N,)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def caption_shape(self) -> tuple[int, int]:
        return tuple(self.states.shape[1:])  # (T, C)

    def caption_rows(self, images: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
        """One caption row per image: uniform over its captions (g given) or its first caption."""
        if g is None:
            return self.first[images]
        pick = (torch.rand(len(images), generator=g) * self.count[images]).long()
        return self.first[images] + pick.clamp(max=self.count[images] - 1)

    def batch(self, images: torch.Tensor, g: torch.Generator | None, device) -> tuple[torch.Tensor, ...]:
        """images (B,) -> tokens (B, L) long, captions (B, T, C) fp32, caption mask (B, T) bool."""
        rows = self.caption_rows(images, g)
        return (self.tokens[images].to(device), self.states[rows].float().to(device),
                self.masks[rows].to(device))


# ---------------------------------------------------------------- the teacher-forced forward


def sequence_mask(cmask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The engine's attention mask for a whole sequence at once: (B, T) caption mask -> (B, 1, S, S).

    Same semantics as KVCache.attn_mask during prefill + decoding: causal; padded caption keys
    are hidden from every query; every query sees itself (a padded caption row is never empty).
    """
    b, t = cmask.shape
    key_valid = torch.cat([cmask, cmask.new_ones(b, seq_len - t)], dim=1)  # (B, S)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cmask.device).tril()  # (S, S)
    mask = causal[None] & key_valid[:, None, :]  # (B, S, S)
    mask |= torch.eye(seq_len, dtype=torch.bool, device=cmask.device)[None]
    return mask[:, None]


def teacher_forced(model: LlamaGenGPT, tokens: torch.Tensor, captions: torch.Tensor,
                   cmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, L), captions (B, T, C), cmask (B, T) ->
    logits (B, L, V) fp32 where logits[:, i] predicts tokens[:, i], and hidden (B, T + L - 1, dim)
    post-norm states at positions 0 .. T + L - 2 (image token i sits at position T + i)."""
    t, length = captions.shape[1], tokens.shape[1]
    s = t + length - 1
    positions = torch.arange(s, device=tokens.device)
    logits, hidden = model(positions, sequence_mask(cmask, s), tokens=tokens[:, :-1], captions=captions)
    return logits[:, t - 1:], hidden


def drop_captions(model: LlamaGenGPT, captions: torch.Tensor, p: float, g: torch.Generator) -> torch.Tensor:
    """Replace each caption (all T rows) by uncond_embedding with probability p; masks unchanged."""
    drop = torch.rand(captions.shape[0], generator=g) < p  # (B,)
    if not drop.any():
        return captions
    uncond = model.cls_embedding.uncond_embedding.to(captions.dtype)  # (T, C)
    return torch.where(drop.to(captions.device)[:, None, None], uncond[None], captions)


# ---------------------------------------------------------------- setup helpers


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast(device: torch.device, amp: str):
    """bf16 autocast context for --amp bf16 (or auto where bf16 is native), else a no-op."""
    use = amp == "bf16" or (amp == "auto" and (device.type == "cuda" or cpu_has_native_bf16()))
    if not use:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def init_weights(model: nn.Module, head: nn.Linear | None = None) -> None:
    """LlamaGen's init: N(0, 0.02) linears and embeddings, the output `head` (a target's) zeroed
    (buffers untouched)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    if head is not None:
        nn.init.zeros_(head.weight)


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, steps: int, lr: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def save_checkpoint(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_target(path: Path) -> LlamaGenGPT:
    """A trained target from a run dir (RUN/ckpt.pt) or a checkpoint file, in eval mode."""
    ckpt = load_checkpoint(path / "ckpt.pt" if path.is_dir() else path)
    model = LlamaGenGPT(GPTConfig(**ckpt["gpt_config"]))
    model.load_state_dict(ckpt["model"], strict=True)
    return model.eval()


def codebook_size(tokenizer: Path) -> int:
    return int(json.loads((tokenizer / "config.json").read_text())["codebook_size"])


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: LlamaGenGPT, data: TokenData, n_images: int, device, amp: str,
             batch_size: int = 32) -> dict[str, float]:
    """Per-token NLL (nats) and top-1 accuracy over the first n_images, each with its first caption."""
    was_training = model.training
    model.eval()
    nll, correct, count = 0.0, 0, 0
    images = torch.arange(min(n_images, len(data)))
    for i in range(0, len(images), batch_size):
        tokens, captions, cmask = data.batch(images[i:i + batch_size], None, device)
        with autocast(device, amp):
            logits, _ = teacher_forced(model, tokens, captions, cmask)
        nll += F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == tokens).sum().item()
        count += tokens.numel()
    model.train(was_training)
    return {"nll": nll / count, "top1": correct / count}


# ---------------------------------------------------------------- main loop


def build(args, tc: TrainConfig, train: TokenData, device):
    ckpt_path = args.out / "ckpt.pt"
    ckpt = load_checkpoint(ckpt_path) if args.resume and ckpt_path.exists() else None
    if ckpt is not None:
        cfg = GPTConfig(**ckpt["gpt_config"])
    else:
        t, c = train.caption_shape
        cfg = GPTConfig(dim=args.dim, n_layer=args.layers, n_head=args.heads,
                        vocab_size=codebook_size(args.tokenizer), cls_token_num=t, caption_dim=c,
                        grid_h=train.grid[0], grid_w=train.grid[1], multiple_of=args.multiple_of,
                        caption_dropout=tc.caption_dropout)
    torch.manual_seed(tc.seed)
    model = LlamaGenGPT(cfg)
    init_weights(model, head=model.output)
    model.to(device).train()
    opt = adamw(model, tc.lr, tc.weight_decay)
    return model, opt, restore(ckpt, model, opt)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                     eval_every=args.eval_every, eval_images=args.eval_images,
                     ckpt_minutes=args.ckpt_minutes, log_every=args.log_every, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train, heldout = TokenData(args.data, "train"), TokenData(args.data, "heldout")
    model, opt, step = build(args, tc, train, device)
    cfg = model.config
    if (cfg.cls_token_num, cfg.caption_dim) != train.caption_shape or cfg.num_image_tokens != train.tokens.shape[1]:
        raise ValueError(f"checkpoint config {cfg} does not match the data in {args.data}")
    log = Logger(args.out / "metrics.jsonl")
    print(f"params={count_parameters(model)} config={cfg.to_dict()} train_config={asdict(tc)} "
          f"start_step={step} train_images={len(train)} heldout_images={len(heldout)} "
          f"device={device} amp={args.amp}", flush=True)

    def save(step: int) -> None:
        save_checkpoint(args.out / "ckpt.pt", model=model.state_dict(), optimizer=opt.state_dict(),
                        step=step, gpt_config=cfg.to_dict(), train_config=asdict(tc),
                        data=str(args.data), tokenizer=str(args.tokenizer))

    def eval_record() -> dict:
        h = evaluate(model, heldout, tc.eval_images, device, args.amp)
        t = evaluate(model, train, tc.eval_images, device, args.amp)
        return {"heldout_nll": h["nll"], "heldout_top1": h["top1"], "train_nll": t["nll"],
                "train_top1": t["top1"]}

    if step == 0 and tc.eval_every:
        log({"step": 0, **eval_record(), "params": count_parameters(model)})
    clock = CheckpointClock(tc.ckpt_minutes, save)
    t0, t_log, s_log = time.time(), time.time(), step
    losses: list[float] = []
    while step < tc.steps:
        g = torch.Generator().manual_seed(tc.seed * 7919 + step)
        images = batch_indices(len(train), step, tc.batch_size, tc.seed)
        tokens, captions, cmask = train.batch(images, g, device)
        captions = drop_captions(model, captions, tc.caption_dropout, g)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc.steps, tc.lr, tc.warmup, tc.final_lr_frac)
        with autocast(device, args.amp):
            logits, _ = teacher_forced(model, tokens, captions, cmask)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % tc.log_every == 0 or step == tc.steps:
            now = time.time()
            rec = {"step": step, "loss": float(np.mean(losses)), "grad_norm": float(grad_norm),
                   "lr": lr_at(step - 1, tc.steps, tc.lr, tc.warmup, tc.final_lr_frac),
                   "steps_per_s": (step - s_log) / (now - t_log), "elapsed_min": (now - t0) / 60}
            losses, t_log, s_log = [], now, step
            if tc.eval_every and (step % tc.eval_every == 0 or step == tc.steps):
                rec.update(eval_record())
            log(rec)
        if clock.tick(step, step == tc.steps):
            return {"step": step, "stopped": True}
    info = {"step": step, "params": count_parameters(model), "config": cfg.to_dict(),
            **(eval_record() if tc.eval_every else {})}
    (args.out / "train_info.json").write_text(json.dumps(info, indent=2))
    print(f"done {json.dumps(info)}", flush=True)
    return info


def add_run_args(p: argparse.ArgumentParser, tc) -> None:
    """Flags every training job shares, with defaults from its TrainConfig class `tc`."""
    p.add_argument("--steps", type=int, default=tc.steps)
    p.add_argument("--batch-size", type=int, default=tc.batch_size)
    p.add_argument("--lr", type=float, default=tc.lr)
    p.add_argument("--warmup", type=int, default=tc.warmup)
    p.add_argument("--eval-every", type=int, default=tc.eval_every, help="0 = never")
    p.add_argument("--eval-images", type=int, default=tc.eval_images)
    p.add_argument("--log-every", type=int, default=tc.log_every)
    p.add_argument("--ckpt-minutes", type=float, default=tc.ckpt_minutes)
    p.add_argument("--seed", type=int, default=tc.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt if present")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--amp", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--threads", type=int, default=1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data/emoji"),
                   help="dir with tokens_*.npy and captions_*.npz (jobs.train.tokenize)")
    p.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer/final"),
                   help="exported VQ dir (its codebook size is the vocabulary)")
    p.add_argument("--out", type=Path, default=Path("runs/target"))
    # 256 x 6 x 4 (5.8M parameters): 4.5 s per step of 16 images on one CPU thread; the issue's
    # example 384 x 8 x 6 (15.2M) takes 11-15 s per step, too slow for 1-2 h here (docs/models.md).
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--multiple-of", type=int, default=256, help="FFN width rounding")
    add_run_args(p, TrainConfig)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
