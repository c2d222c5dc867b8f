"""jobs.train_drafter's export: OUT/drafter (the head type's config.json + fp16 safetensors +
provenance.json) and, for a bundle directory, OUT/bundle (the source bundle with this drafter)."""

from __future__ import annotations

import json

import torch

from pipeline.storage import Storage
from jobs.train.heads import HEADS


def export(cfg, out: Storage, bundle, drafter, provenance: dict,
           family: str = "llamagen") -> dict[str, str]:
    """OUT/drafter (fp16 component + provenance) and, for a bundle directory, OUT/bundle."""
    from safetensors.torch import save as save_safetensors

    state = {k: v.detach().to("cpu", torch.float16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in drafter.state_dict().items()}
    files = {"drafter/config.json": json.dumps(HEADS[family].config_dict(drafter), indent=2).encode(),
             "drafter/model.safetensors": save_safetensors(state),
             "drafter/provenance.json": (json.dumps(provenance, indent=2, default=str) + "\n").encode()}
    written = {"drafter": out.uri_for("drafter")}
    from adt_core.bundles.bundle import resolve_bundle_dir

    try:
        src = resolve_bundle_dir(cfg.bundle)
    except (FileNotFoundError, OSError):
        src = None
    if cfg.export_bundle and src is not None and src.is_dir():
        files.update(bundle_files(src, cfg.run_name))
        for name in ("config.json", "model.safetensors", "provenance.json"):
            files[f"bundle/drafter/{name}"] = files[f"drafter/{name}"]
        written["bundle"] = out.uri_for("bundle")
    for key, data in files.items():
        out.put_bytes(key, data)
    return written


def bundle_files(src, run_name: str) -> dict[str, bytes]:
    """bundle/... files of the source bundle directory with the drafter replaced: every component
    but the drafter copied once under the name of the first part that uses it (a family bundle's
    parts may share one directory, e.g. Janus' target, VQ and tokenizer), bundle.json repointed."""
    meta = json.loads((src / "bundle.json").read_text())
    comps, files, placed = dict(meta["components"]), {}, {}
    for part, rel in comps.items():
        if part == "drafter" or not rel:
            continue
        path = (src / rel).resolve()
        if path not in placed:
            placed[path] = part if path.is_dir() else f"{part}/{path.name}"
            for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
                if f.is_file():
                    name = f.relative_to(path).as_posix() if path.is_dir() else f.name
                    files[f"bundle/{part}/{name}"] = f.read_bytes()
        comps[part] = placed[path]
    comps["drafter"] = "drafter"
    meta["components"] = comps
    meta["name"] = f"{meta['name']}+{run_name}"
    files["bundle/bundle.json"] = (json.dumps(meta, indent=2) + "\n").encode()
    return files
