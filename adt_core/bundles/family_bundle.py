"""Bundle directories of model families other than LlamaGen (adt_core/families/contract.py).

    bundle.json   {"name": ..., "family": "chameleon",
                   "components": {"target": "target", "drafter": "drafter" | null, "vq": "vq",
                                  "tokenizer": "target", "neighbours": "drafter/top_8191_indices.npy"},
                   "prompt": {...the family's prompter options, e.g. "layout": "lumina", "width": 768},
                   "sampling": {...SamplingConfig fields}}

Each component path is relative to the bundle directory (or absolute) and is read by the family's
loader in its published on-disk layout (Chameleon: an HF target directory, a LANTERN drafter
directory, Meta's vqgan.yaml + vqgan.ckpt, tokenizer.json). The Bundle's parts come from the
family: target, drafter, decoder (`vq`) and prompter; it has no text encoder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adt_core.bundles.bundle import Bundle
from adt_core.config import SamplingConfig
from adt_core.families.registry import get_family


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NEIGHBOURS_GLOB = "top_*_indices.npy"  # LANTERN's neighbour table, shipped in its drafter directory


def _part(base: Path, rel: str | None) -> Path | None:
    if rel is None:
        return None
    p = Path(rel)
    return p if p.is_absolute() else base / p


def find_neighbours(drafter_dir: Path | None) -> Path | None:
    """LANTERN's top_{V-1}_indices.npy in a drafter directory, when it ships one."""
    if drafter_dir is None or not drafter_dir.is_dir():
        return None
    found = sorted(drafter_dir.glob(NEIGHBOURS_GLOB))
    return found[0] if found else None


def build_family_bundle(name: str, family_name: str, parts: dict[str, Path | None], prompt: dict | None = None,
                        sampling: SamplingConfig | None = None, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> Bundle:
    """A Bundle from local parts in the family's published layouts: target, vq, and optionally
    drafter, tokenizer (default: the target's folder) and neighbours (LANTERN's table; default:
    the one in the drafter directory, else none: the relaxation reads the decoder's codebook)."""
    family = get_family(family_name)
    target = family.load_target(parts["target"], dtype=dtype, device=device)
    drafter = None
    if parts.get("drafter") is not None:
        drafter = family.load_drafter(parts["drafter"], target, dtype=dtype, device=device)
    vq = family.load_decoder(parts["vq"], device=device)
    prompter = family.load_prompter(parts.get("tokenizer") or parts["target"], **(prompt or {}))
    layout = prompter.layout
    neighbours = parts.get("neighbours") or find_neighbours(parts.get("drafter"))
    return Bundle(name=name, text_encoder=None, target=target, drafter=drafter, vq=vq,
                  grid=(layout.grid_h, layout.grid_w), sampling=sampling or SamplingConfig(),
                  family=family.name, prompter=prompter, neighbours=neighbours)


def load_family_bundle(path: str | Path, meta: dict | None = None, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu"):
    """A Bundle from a family bundle directory (bundle.json names the family). On device
    "meta" the loaders check every file (headers, shapes) and load no weights: what the job's
    driver does before Ray starts, and what the memory plan counts."""
    path = Path(path)
    meta = meta if meta is not None else json.loads((path / "bundle.json").read_text())
    comps = meta.get("components", {})
    missing = [k for k in ("target", "vq") if not comps.get(k)]
    if missing:
        raise ValueError(f"{path / 'bundle.json'}: components need {', '.join(missing)}")
    parts = {k: _part(path, comps.get(k)) for k in ("target", "drafter", "vq", "tokenizer", "neighbours")}
    return build_family_bundle(meta.get("name", path.name), meta["family"], parts, meta.get("prompt", {}),
                               SamplingConfig(**meta.get("sampling", {})), dtype, device)


def write_family_bundle(path: str | Path, name: str, family: str, components: dict, prompt: dict | None = None,
                        sampling: SamplingConfig | None = None) -> Path:
    """Write bundle.json for parts already on disk in their published layouts."""
    import dataclasses

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"name": name, "family": family, "components": components, "prompt": prompt or {},
            "sampling": dataclasses.asdict(sampling) if sampling is not None else {}}
    (path / "bundle.json").write_text(json.dumps(meta, indent=2))
    return path
