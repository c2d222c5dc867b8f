"""Acceptance length of a drafter against its target, on held-out prompts.

    python -m jobs.train.eval --bundle emoji16 --prompts examples/prompts.parquet \
        [--drafter outputs/train_emoji16/drafter | outputs/train_emoji16/train/<run>/checkpoint_.../] \
        [--methods eagle2,adt] [--temperatures 0,default] [--json out.json]

For each method and temperature the engine (adt_core.Generator, DecodeConfig(method=...,
temperature=...)) decodes every prompt with its seed, and the reported value is the mean over
images of StepStats.mean_acceptance_length (tokens committed per round, the bonus token
included: vLLM's definition). `default` is the bundle's sampling temperature (with its top-k,
top-p and CFG). The drafter is the bundle's own unless --drafter names an exported component
(config.json + model.safetensors) or a training checkpoint directory (state.pt).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import pyarrow.parquet as pq
import torch

from adt_core import DecodeConfig, Generator
from adt_core.families.llamagen.drafter import Drafter, DrafterConfig

Temperature = Union[float, str]  # a float, or "default" (the bundle's)


def parse_temperature(raw: Temperature) -> Optional[float]:
    """None for the bundle default, else the float."""
    if isinstance(raw, str) and raw.strip().lower() in ("default", "defaults", "none"):
        return None
    return float(raw)


def acceptance(bundle, drafter: Drafter | None, prompts: Sequence[str], seeds: Sequence[int],
               methods: Sequence[str] = ("eagle2", "adt"), temperatures: Sequence[Temperature] = (0.0, "default"),
               batch_size: int = 16, device: str = "cpu", max_tokens: Optional[int] = None,
               on_record: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """One record per (method, temperature): mean acceptance length over the prompts, and time
    (`on_record` sees each as it is done)."""
    if drafter is not None:
        bundle = dataclasses.replace(bundle, drafter=drafter.float().eval())
    out = []
    for method in methods:
        for raw in temperatures:
            temp = parse_temperature(raw)
            gen = Generator(bundle, DecodeConfig(method=method, temperature=temp, batch_size=batch_size,
                                                 device=device, max_tokens=max_tokens))
            t0 = time.perf_counter()
            results = gen.generate(list(prompts), list(seeds))
            lengths = [r.stats.mean_acceptance_length for r in results]
            out.append({"method": method, "temperature": "default" if temp is None else temp,
                        "sampling": dataclasses.asdict(gen.sampling), "images": len(results),
                        "mean_acceptance_length": sum(lengths) / max(len(lengths), 1),
                        "seconds": time.perf_counter() - t0})
            if on_record is not None:
                on_record(out[-1])
    return out


def drafter_from_state(state: dict, family: str = "llamagen", target=None):
    """The drafter of a training checkpoint's state (its family's head type; Janus' needs the target)."""
    from jobs.train.heads import HEADS

    return HEADS[family].from_state(state, target)


def load_drafter_path(path: Path) -> Drafter:
    """An exported component (config.json + model.safetensors) or a checkpoint dir (state.pt)."""
    from adt_core.bundles.bundle import _load_component  # the bundle format's own strict loader

    if (path / "state.pt").is_file():
        return drafter_from_state(torch.load(path / "state.pt", map_location="cpu", weights_only=True))
    return _load_component(Drafter, DrafterConfig, path)


def read_prompts(path: str, limit: Optional[int] = None) -> tuple[list[str], list[int]]:
    rows = pq.read_table(path, columns=["prompt", "seed"]).to_pylist()[:limit]
    return [r["prompt"] for r in rows], [int(r["seed"]) for r in rows]


def main(argv: list[str] | None = None) -> int:
    from pipeline.worker import load_bundle_spec

    p = argparse.ArgumentParser(prog="python -m jobs.train.eval", description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default="emoji16")
    p.add_argument("--prompts", default="examples/prompts.parquet")
    p.add_argument("--drafter", type=Path, default=None, help="component dir or checkpoint dir (default: the bundle's)")
    p.add_argument("--methods", default="eagle2")
    p.add_argument("--temperatures", default="0,default")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the records here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bundle = load_bundle_spec(args.bundle)
    drafter = load_drafter_path(args.drafter) if args.drafter else None
    prompts, seeds = read_prompts(args.prompts, args.limit)
    show = lambda r: print(f"{r['method']:7s} T={r['temperature']!s:8s} mean acceptance length "  # noqa: E731
                           f"{r['mean_acceptance_length']:.3f} ({r['images']} images, {r['seconds']:.0f} s)", flush=True)
    records = acceptance(bundle, drafter, prompts, seeds, args.methods.split(","), args.temperatures.split(","),
                         args.batch_size, on_record=show)
    if args.json:
        args.json.write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
