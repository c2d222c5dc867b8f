"""Bundle directories of model families other than LlamaGen (adt_core/models/contract.py).

    bundle.json   {"name": ..., "family": "chameleon",
                   "components": {"target": "target", "drafter": "drafter" | null, "vq": "vq",
                                  "tokenizer": "target"},
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

from adt_core.config import SamplingConfig
from adt_core.models.bundle import Bundle
from adt_core.models.contract import get_family


def _part(base: Path, rel: str | None) -> Path | None:
    if rel is None:
        return None
    p = Path(rel)
    return p if p.is_absolute() else base / p


def load_family_bundle(path: str | Path, meta: dict | None = None, dtype: torch.dtype = torch.float32):
    """A Bundle from a family bundle directory (bundle.json names the family)."""
    path = Path(path)
    meta = meta if meta is not None else json.loads((path / "bundle.json").read_text())
    family = get_family(meta["family"])
    comps = meta.get("components", {})
    missing = [k for k in ("target", "vq") if not comps.get(k)]
    if missing:
        raise ValueError(f"{path / 'bundle.json'}: components need {', '.join(missing)}")
    target = family.load_target(_part(path, comps["target"]), dtype=dtype)
    drafter = None
    if comps.get("drafter"):
        drafter = family.load_drafter(_part(path, comps["drafter"]), target, dtype=dtype)
    vq = family.load_decoder(_part(path, comps["vq"]))
    prompter = family.load_prompter(_part(path, comps.get("tokenizer") or comps["target"]), **meta.get("prompt", {}))
    layout = prompter.layout
    return Bundle(name=meta.get("name", path.name), text_encoder=None, target=target, drafter=drafter, vq=vq,
                  grid=(layout.grid_h, layout.grid_w), sampling=SamplingConfig(**meta.get("sampling", {})),
                  family=family.name, prompter=prompter)


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
