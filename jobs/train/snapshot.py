"""Carry unfinished training runs across machines through git.

A session's machine (and its ignored runs/ folder) does not survive the session, so a long CPU
training run is handed over as a compact snapshot in `train_state/` (tracked): model weights in
fp16 safetensors plus the step and configs, without optimizer moments (the next session resumes
with a fresh AdamW at the saved step: the learning-rate schedule continues where it was).

    python -m jobs.train.snapshot save runs/target train_state/target
    python -m jobs.train.snapshot restore train_state/target runs/target
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save(run_dir: Path, dest: Path) -> None:
    ckpt = torch.load(run_dir / "ckpt.pt", map_location="cpu", weights_only=True)
    dest.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dest / "model.safetensors"))
    meta = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}
    (dest / "state.json").write_text(json.dumps(meta, indent=2, default=str))
    for name in ("metrics.jsonl",):
        if (run_dir / name).exists():
            (dest / name).write_text((run_dir / name).read_text())
    print(f"snapshot of {run_dir} at step {meta.get('step')} -> {dest}")


def restore(src: Path, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "ckpt.pt").exists():
        sys.exit(f"{run_dir / 'ckpt.pt'} exists: not overwriting a live run")
    meta = json.loads((src / "state.json").read_text())
    model = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(src / "model.safetensors")).items()}
    torch.save({**meta, "model": model, "optimizer": None}, run_dir / "ckpt.pt")
    if (src / "metrics.jsonl").exists() and not (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").write_text((src / "metrics.jsonl").read_text())
    print(f"restored {src} (step {meta.get('step')}) -> {run_dir / 'ckpt.pt'} (fresh optimizer)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.train.snapshot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["save", "restore"])
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    a = ap.parse_args(argv)
    (save if a.action == "save" else restore)(a.src, a.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
