"""Encode the emoji set for AR training: image token grids + precomputed caption states.

    python -m jobs.train.tokenize --data data/emoji --tokenizer runs/tokenizer/final [--threads 2]

Reads DATA/{train,heldout}_images.npy and DATA/{train,heldout}_captions.json (see
jobs/train/data.py) and writes, next to them (or in --out):

    tokens_{split}.npy     int16 (N, H, W)  the tokenizer's codes of every image
    captions_{split}.npz   states fp16 (M, T, C)  text-encoder token states of every caption
                           (valid rows at the end, padding rows zero, as the encoder returns them)
                           masks  bool (M, T)     True on valid rows
                           image  int32 (M,)      index of the caption's image in tokens_{split}
                           source str             text encoder spec + sha256 of the captions
    tokens_meta.json       tokenizer dir, codebook size, grid, text encoder spec, counts

The caption states go through the same `encode` as at generation time (the text encoder of the
bundle, by default {"type": "minilm"}: 32 x 384), so training and inference see identical rows.
Caption states do not depend on the tokenizer: an existing captions_{split}.npz made from the
same captions with the same encoder spec is kept (--redo-captions to recompute), and
`--only captions` encodes them before any tokenizer exists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from adt_core.bundles.bundle import build_text_encoder
from adt_core.families.vqgan import VQModel, from_pretrained

SPLITS = ("train", "heldout")
DEFAULT_TEXT_ENCODER = {"type": "minilm"}


@torch.no_grad()
def encode_images(vq: VQModel, images: np.ndarray, batch_size: int = 128) -> np.ndarray:
    """uint8 (N, S, S, 3) -> int16 codes (N, S/f, S/f)."""
    if vq.cfg.codebook_size > np.iinfo(np.int16).max + 1:
        raise ValueError(f"codebook of {vq.cfg.codebook_size} codes does not fit int16")
    out = [vq.encode(torch.from_numpy(images[i:i + batch_size])).to(torch.int16).numpy()
           for i in range(0, len(images), batch_size)]
    return np.concatenate(out)


@torch.no_grad()
def encode_captions(encoder, captions: list[list[str]], batch_size: int = 256,
                    progress: bool = False) -> dict[str, np.ndarray]:
    """Per-image caption lists -> {"states" fp16 (M, T, C), "masks" bool (M, T), "image" int32 (M,)}."""
    flat = [(i, c) for i, caps in enumerate(captions) for c in caps]
    states, masks = [], []
    t0 = time.time()
    for k in range(0, len(flat), batch_size):
        emb, mask = encoder.encode([c for _, c in flat[k:k + batch_size]])  # (b, T, C), (b, T)
        states.append(emb.to(torch.float16).cpu().numpy())
        masks.append(mask.cpu().numpy())
        if progress:
            done = min(k + batch_size, len(flat))
            print(f"captions {done}/{len(flat)} ({time.time() - t0:.0f}s)", flush=True)
    return {"states": np.concatenate(states), "masks": np.concatenate(masks),
            "image": np.array([i for i, _ in flat], dtype=np.int32)}


def caption_source(spec: dict, captions: list[list[str]]) -> str:
    """What a captions_{split}.npz was made from: encoder spec + hash of the caption lists."""
    digest = hashlib.sha256(json.dumps(captions).encode()).hexdigest()
    return json.dumps({"text_encoder": spec, "captions_sha256": digest}, sort_keys=True)


def existing_source(path: Path) -> str | None:
    if not path.exists():
        return None
    with np.load(path) as f:
        return str(f["source"]) if "source" in f.files else None


def run(args) -> None:
    torch.set_num_threads(args.threads)
    out = args.out or args.data
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "tokens_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.setdefault("counts", {})
    spec = json.loads(args.text_encoder)
    encoder = None
    vq = from_pretrained(args.tokenizer) if args.only in ("all", "tokens") else None
    if vq is not None:
        meta.update(tokenizer=str(args.tokenizer), codebook_size=vq.cfg.codebook_size)
    for split in SPLITS:
        counts = meta["counts"].setdefault(split, {})
        if vq is not None:
            images = np.load(args.data / f"{split}_images.npy")
            t0 = time.time()
            tokens = encode_images(vq, images)
            np.save(out / f"tokens_{split}.npy", tokens)
            meta["grid"] = list(tokens.shape[1:])
            counts["images"] = int(len(images))
            print(f"{split}: {len(images)} images -> tokens {tokens.shape} in {time.time() - t0:.0f}s "
                  f"({len(np.unique(tokens))} distinct codes)", flush=True)
        if args.only == "tokens":
            continue
        captions = json.loads((args.data / f"{split}_captions.json").read_text())
        if counts.get("images") not in (None, len(captions)):
            raise ValueError(f"{split}: {counts['images']} images but {len(captions)} caption lists")
        source = caption_source(spec, captions)
        path = out / f"captions_{split}.npz"
        if not args.redo_captions and existing_source(path) == source:
            print(f"{split}: keeping {path} (same captions, same text encoder)", flush=True)
        else:
            encoder = encoder or build_text_encoder(spec)
            t0 = time.time()
            caps = encode_captions(encoder, captions, args.batch_size, progress=args.progress)
            np.savez(path, **caps, source=np.array(source))
            print(f"{split}: {len(caps['image'])} captions -> states {caps['states'].shape} in "
                  f"{time.time() - t0:.0f}s", flush=True)
        with np.load(path) as f:
            counts["captions"] = int(f["image"].shape[0])
            meta.update(text_encoder=spec, caption_tokens=int(f["states"].shape[1]),
                        caption_dim=int(f["states"].shape[2]))
    meta_path.write_text(json.dumps(meta, indent=2))
    print(f"wrote {meta_path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data/emoji"))
    p.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer/final"),
                   help="exported VQ dir (config.json + model.safetensors)")
    p.add_argument("--out", type=Path, default=None, help="output dir (default: --data)")
    p.add_argument("--text-encoder", default=json.dumps(DEFAULT_TEXT_ENCODER),
                   help='text encoder spec as JSON, e.g. \'{"type": "minilm"}\'')
    p.add_argument("--batch-size", type=int, default=256, help="captions per encoder call")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=("all", "tokens", "captions"), default="all",
                   help="captions need no tokenizer; tokens need no text encoder")
    p.add_argument("--redo-captions", action="store_true",
                   help="re-encode captions even if an up-to-date captions_{split}.npz exists")
    p.add_argument("--progress", action="store_true", help="print a line per caption batch")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
