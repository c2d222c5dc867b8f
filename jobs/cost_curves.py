"""Cost curves (`python -m jobs.bench --cost-curves`): ms of one target forward carrying n new
tokens per image, for B images in flight, on a cached mid-image prefix.

What speculation can win is the shape of these curves: a verify forward of 1 + m tokens per
image costs cost(B, 1 + m) where a plain step costs cost(B, 1). Flat curves (a GPU at small B,
any weight-bound model) pay for wide trees; steep ones (a CPU, a large B) do not. Besides the
chosen bundle, `--xl` measures a random-weight target of LlamaGen-XL's shape (775 M parameters,
36 layers, dim 1280, 120 caption rows, 16 x 16 grid) in bf16: the size users run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adt_core.bundles.deepen import describe
from adt_core.calibrate import measure_target_cost, typical_prefix
from adt_core.families.llamagen.model import GPTConfig, LlamaGenGPT

TOKENS = (1, 2, 4, 8, 16, 32, 64)
BATCHES = (1, 16, 64)


def xl_target(device: str, dtype: torch.dtype) -> LlamaGenGPT:
    """A random-weight target with LlamaGen-XL's shapes (no checkpoint needed)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaGenGPT(GPTConfig.llamagen("XL", grid=16))
    model = model.to_empty(device=device).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.cls_embedding.uncond_embedding.normal_()
    return model.eval()


def curves(target: LlamaGenGPT, rows: int, prefix: int, batches=BATCHES, tokens=TOKENS, repeats: int = 5) -> dict:
    """{batch: {n: ms}} for a forward of n new tokens on each of `batch` images (rows each) after
    `prefix` cached entries."""
    out = {}
    for b in batches:
        sizes = tuple(b * n for n in tokens)
        table = measure_target_cost(target, rows=rows, sizes=sizes, repeats=repeats, warmup=2, slots=b,
                                    prefix_len=prefix)
        out[b] = {n: table.ms[b * n] for n in tokens}
    return out


def markdown(name: str, table: dict) -> str:
    ns = sorted(next(iter(table.values())))
    lines = [f"**{name}**: ms of one target forward with n new tokens per image (x: relative to n = 1)", "",
             "| B | " + " | ".join(f"n={n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
    for b, row in table.items():
        cells = [f"{row[ns[0]]:.2f} ms"] + [f"{row[n] / row[ns[0]]:.2f}x" for n in ns[1:]]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(bundle, device: str, dtype: str, xl: bool, out_json: str | None) -> dict:
    result = {}
    rows = 2 if bundle.sampling.use_cfg else 1
    target = bundle.target.to(device, getattr(torch, dtype))
    result[f"{describe(bundle.name)} {dtype}"] = curves(target, rows, typical_prefix(bundle.make_prompter()))
    if xl:
        xlt = xl_target(device, torch.bfloat16)  # its caption rows plus half its image
        result["LlamaGen-XL shape (random) bfloat16"] = curves(xlt, 2, xlt.config.cls_token_num
                                                               + xlt.config.num_image_tokens // 2)
    for name, table in result.items():
        print(markdown(name, table) + "\n", flush=True)
    if out_json:
        Path(out_json).write_text(json.dumps({k: {str(b): v for b, v in t.items()} for k, t in result.items()},
                                             indent=2))
        Path(out_json).with_suffix(".md").write_text("\n\n".join(markdown(k, t) for k, t in result.items()) + "\n")
    return result
