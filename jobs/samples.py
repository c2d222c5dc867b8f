"""Sample grid of a bundle: a few prompts x a few seeds, each row labelled with its prompt.

    python -m jobs.samples --out docs/img/emoji16_samples.png
    python -m jobs.samples --rows p000,p003 --seeds 0,1 --method eagle2 --temperature 0

Rows come from a prompts Parquet by prompt id; the default picks 8 training and 8 held-out
captions of `examples/prompts.parquet` (p000-p047 are training captions, p048-p063 held out).
Sampling uses the bundle's defaults unless overridden; method `ar` (the default) draws from the
target itself, so the grid shows the model, not the speculative decoder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageDraw

from adt_core import DecodeConfig, Generator, load_bundle
from pipeline.cli import CliParser

DEFAULT_ROWS = ("p000,p001,p002,p010,p020,p030,p040,p046,"  # training captions
                "p048,p049,p050,p052,p054,p056,p058,p060")  # held-out captions
LABEL_W = 330


def read_rows(path: str, ids: list[str]) -> list[tuple[str, str]]:
    """(prompt_id, prompt) for the requested ids, in the requested order."""
    table = {r["prompt_id"]: r["prompt"] for r in pq.read_table(path, columns=["prompt_id", "prompt"]).to_pylist()}
    missing = [i for i in ids if i not in table]
    if missing:
        raise SystemExit(f"prompt ids not in {path}: {missing}")
    return [(i, table[i]) for i in ids]


def compose(rows: list[tuple[str, list[np.ndarray]]], scale: int, split_after: int | None) -> Image.Image:
    """rows of (label, images (h, w, 3) uint8) -> one labelled grid; a line after `split_after` rows."""
    h, w = rows[0][1][0].shape[:2]
    cell_h, cell_w = h * scale + 4, w * scale + 4
    cols = max(len(imgs) for _, imgs in rows)
    grid = Image.new("RGB", (LABEL_W + cols * cell_w, len(rows) * cell_h), "white")
    draw = ImageDraw.Draw(grid)
    for r, (label, imgs) in enumerate(rows):
        y = r * cell_h
        draw.text((6, y + cell_h // 2 - 6), label[:52], fill=(0, 0, 0))
        for c, img in enumerate(imgs):
            tile = Image.fromarray(img).resize((w * scale, h * scale), Image.NEAREST)
            grid.paste(tile, (LABEL_W + c * cell_w + 2, y + 2))
    if split_after is not None and 0 < split_after < len(rows):
        y = split_after * cell_h
        draw.line([(0, y - 1), (grid.width, y - 1)], fill=(200, 0, 0), width=2)
    return grid


def main(argv=None) -> int:
    ap = CliParser("python -m jobs.samples", description=__doc__)
    ap.add_argument("--bundle", default="emoji16")
    ap.add_argument("--prompts", default="examples/prompts.parquet")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="comma list of prompt ids, one grid row each")
    ap.add_argument("--heldout-from", default="p048", help="prompt ids >= this are labelled held-out")
    ap.add_argument("--seeds", default="0,1,2,3", help="comma list of seeds, one column each")
    ap.add_argument("--method", default="ar", choices=["ar", "static", "eagle2", "adt"])
    ap.add_argument("--temperature", type=float, default=None, help="default: the bundle's")
    ap.add_argument("--scale", type=int, default=2, help="pixel upscaling of each image")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="docs/img/emoji16_samples.png")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle(args.bundle)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = read_rows(args.prompts, [i.strip() for i in args.rows.split(",") if i.strip()])
    kw = {} if args.temperature is None else {"temperature": args.temperature}
    gen = Generator(bundle, DecodeConfig(method=args.method, device="cpu", **kw))
    out_rows, split_after = [], None
    for n, (pid, prompt) in enumerate(rows):
        held = pid >= args.heldout_from
        if held and split_after is None:
            split_after = n
        results = gen.generate([prompt] * len(seeds), seeds)
        out_rows.append((f"{'[held-out] ' if held else ''}{prompt}", [r.image for r in results]))
        print(f"{pid} {prompt!r}: done", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    compose(out_rows, args.scale, split_after).save(args.out)
    print(f"wrote {args.out} ({len(rows)} prompts x {len(seeds)} seeds, method {args.method}, "
          f"sampling {gen.sampling})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
