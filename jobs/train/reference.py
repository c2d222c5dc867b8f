"""A bundle's reference output: one greedy token grid, stored beside the weights at export.

The test suite regenerates it (tests/adt_core/test_emoji16.py), so any change to weights
loading, RoPE, masks, CFG or sampling that alters a token shows up. Greedy decoding of a
different CPU can flip a near-tie between the two best tokens; export therefore picks, among
a few prompts, the one whose guided logits have the widest smallest top-1 / top-2 margin over
the whole grid, and stores that margin too.

    python -m jobs.train.reference adt_core/bundles/emoji16     # (re)write reference.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from adt_core import DecodeConfig, Generator, load_bundle
from adt_core.bundles.bundle import Bundle
from adt_core.round.sampling import cfg_mix
from jobs.train.target import teacher_forced

CANDIDATES = ("an emoji of a grinning face", "red heart", "an emoji of a cat face", "pizza",
              "an emoji of a sun", "thumbs up")
FILE = "reference.json"


@torch.inference_mode()
def greedy_margins(bundle: Bundle, prompt: str, tokens: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """tokens (N,) -> (N,) top-1 minus top-2 of the guided logits predicting each token (fp32,
    one teacher-forced forward over cond + uncond rows)."""
    target = bundle.target.float()
    captions, cmask = bundle.text_encoder.encode([prompt])  # (1, T, C), (1, T)
    if cfg_scale != 1.0:
        uncond = target.cls_embedding.uncond_embedding.to(captions.dtype).expand_as(captions)
        captions, cmask = torch.cat([captions, uncond]), torch.cat([cmask, cmask])
    rows = tokens[None].expand(captions.shape[0], -1)  # (R, N)
    logits, _ = teacher_forced(target, rows, captions, cmask)  # (R, N, V)
    top2 = cfg_mix(logits, cfg_scale)[0].topk(2, dim=-1).values  # (N, 2)
    return top2[:, 0] - top2[:, 1]


def make_reference(bundle: Bundle, candidates=CANDIDATES) -> dict:
    """Greedy AR grids of each candidate prompt; keep the one least likely to flip elsewhere."""
    config = DecodeConfig(method="ar", temperature=0.0, dtype="float32", device="cpu")
    gen = Generator(bundle, config)
    best = None
    for prompt in candidates:
        tokens = gen.generate([prompt], [0])[0].tokens  # (H, W)
        margin = float(greedy_margins(bundle, prompt, tokens.flatten(), gen.sampling.cfg_scale).min())
        if best is None or margin > best["min_margin"]:
            best = {"prompt": prompt, "seed": 0, "config": config.to_dict(), "cfg_scale": gen.sampling.cfg_scale,
                    "min_margin": margin, "tokens": tokens.tolist()}
    return best


def write_reference(bundle_dir: Path) -> dict:
    ref = make_reference(load_bundle(bundle_dir))
    (Path(bundle_dir) / FILE).write_text(json.dumps(ref) + "\n")
    print(f"reference: {ref['prompt']!r}, smallest top-1/top-2 logit margin {ref['min_margin']:.4f}")
    return ref


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    write_reference(p.parse_args(argv).bundle)
    return 0


if __name__ == "__main__":
    main()
