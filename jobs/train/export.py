"""Assemble the embedded bundle from the trained tokenizer, target and drafter.

    python -m jobs.train.export --tokenizer runs/tokenizer/final --target runs/target \
        --drafter runs/drafter --data data/emoji --out adt_core/bundles/emoji16

Writes the bundle directory of adt_core/bundles/bundle.py with save_bundle (bundle.json,
{target,drafter,vq}/config.json + model.safetensors in fp16) plus provenance.json (the runs it
came from and their final metrics) and reference.json (jobs.train.reference), prints each component's size and refuses a bundle over
--max-mb. The text encoder spec comes from DATA/tokens_meta.json (what the captions were
encoded with), so the bundle encodes prompts exactly as the training data was encoded.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from adt_core.bundles.bundle import Bundle, save_bundle
from adt_core.config import SamplingConfig
from adt_core.families.vqgan import from_pretrained
from jobs.train.drafter import load_drafter
from jobs.train.reference import write_reference
from jobs.train.target import load_target

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class TextEncoderSpec:
    """Stands in for the text encoder when saving: save_bundle only needs its config()."""

    def __init__(self, spec: dict, max_tokens: int, dim: int) -> None:
        self.spec, self.max_tokens, self.dim = spec, max_tokens, dim

    def config(self) -> dict:
        return dict(self.spec)

    def encode(self, prompts):  # pragma: no cover - never used for export
        raise RuntimeError("TextEncoderSpec cannot encode; load the bundle to generate")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def run(args) -> dict:
    target = load_target(args.target)
    drafter = load_drafter(args.drafter) if args.drafter is not None else None
    vq = from_pretrained(args.tokenizer)
    tc = target.config
    if vq.cfg.codebook_size != tc.vocab_size:
        raise ValueError(f"tokenizer has {vq.cfg.codebook_size} codes, target vocab is {tc.vocab_size}")
    if drafter is not None and drafter.config.vocab_size != tc.vocab_size:
        raise ValueError("drafter and target vocabularies differ")
    meta = _read_json(args.data / "tokens_meta.json") or {}
    spec = json.loads(args.text_encoder) if args.text_encoder else meta.get("text_encoder", {"type": "minilm"})
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              cfg_scale=args.cfg_scale)
    bundle = Bundle(name=args.name, text_encoder=TextEncoderSpec(spec, tc.cls_token_num, tc.caption_dim),
                    target=target, drafter=drafter, vq=vq, grid=(tc.grid_h, tc.grid_w), sampling=sampling)
    out = save_bundle(bundle, args.out, dtype=DTYPES[args.dtype])
    runs = {"tokenizer": args.tokenizer, "target": args.target, "drafter": args.drafter}
    provenance = {"runs": {k: str(v) for k, v in runs.items() if v is not None},
                  "data": str(args.data), "dtype": args.dtype,
                  "train_info": {k: _read_json(Path(v) / "train_info.json") for k, v in runs.items()
                                 if v is not None and Path(v).is_dir()}}
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2))
    if args.reference:
        write_reference(out)
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    total = sum(sizes.values())
    for name, size in sizes.items():
        print(f"{size / 1e6:9.3f} MB  {name}")
    print(f"{total / 1e6:9.3f} MB  total in {out}")
    if total > args.max_mb * 1e6:
        raise SystemExit(f"bundle is {total / 1e6:.1f} MB > --max-mb {args.max_mb}")
    return {"path": str(out), "bytes": total, "files": sizes}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer/final"))
    p.add_argument("--target", type=Path, default=Path("runs/target"), help="run dir or ckpt file")
    p.add_argument("--drafter", type=Path, default=Path("runs/drafter"),
                   help="run dir or ckpt file (--no-drafter to leave it out)")
    p.add_argument("--no-drafter", dest="drafter", action="store_const", const=None)
    p.add_argument("--data", type=Path, default=Path("data/emoji"),
                   help="dir with tokens_meta.json (the text encoder spec of the training captions)")
    p.add_argument("--text-encoder", default=None, help="override the text encoder spec (JSON)")
    p.add_argument("--out", type=Path, default=Path("adt_core/bundles/emoji16"))
    p.add_argument("--name", default="emoji16")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=150)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--cfg-scale", type=float, default=3.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--max-mb", type=float, default=60.0)
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip reference.json (a stored greedy token grid the tests regenerate)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
