"""Manifests of model families with their own published layouts (a top-level `family`).

    name: anole-7b
    family: chameleon                         # adt_core/families/contract.py registry
    target:    {path: hf://leloy/Anole-7b-v0.1-hf/}             # the family's own layout
    drafter:   {path: hf://jadohu/anole_drafter/}                # optional
    vq:        {path: hf://GAIR/Anole-7b-v0.1/tokenizer/, files: [vqgan.yaml, vqgan.ckpt]}
    tokenizer: {path: hf://leloy/Anole-7b-v0.1-hf/}             # optional: the target's folder
    neighbours: hf://jadohu/anole_drafter/top_8191_indices.npy   # optional: LANTERN's table
    prompt:    {layout: anole}                # the family prompter's options
    grid: 24                                  # optional: passed to the prompter as `grid`
    sampling:  {temperature: 1.0, top_k: 2000, top_p: 1.0, cfg_scale: 3.0}
    dtype: bfloat16                           # weights as loaded (the Generator casts anyway)
    license:   {model: ..., model_url: ...}   # what the user accepts (informational)

A component is a path or a mapping with `path`, optional `sha256` (as in bundles/manifest.py)
and optional `files`: the file names to fetch under a directory `path` (for folders whose
files the Hub directory filter would skip, e.g. Meta's vqgan.yaml + vqgan.ckpt); the part
then loads from the folder they land in. Paths are local, s3:// or hf:// (bundles/cache.py).

`read_family_manifest` validates without reading a checkpoint; `load_family_manifest` fetches
and loads through the family's loaders (bundles/family_bundle.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from adt_core.bundles.bundle import Bundle
from adt_core.bundles.cache import LocalCache
from adt_core.bundles.family_bundle import DTYPES, build_family_bundle
from adt_core.bundles.manifest import _check_sha_field, _expand
from adt_core.bundles.sources import ManifestError
from adt_core.config import SamplingConfig
from adt_core.families.registry import get_family

PARTS = ("target", "drafter", "vq", "tokenizer", "neighbours")
TOP_LEVEL = {"name", "family", *PARTS, "prompt", "grid", "sampling", "dtype", "cache_dir", "license"}
COMPONENT_KEYS = {"path", "sha256", "files"}


@dataclass(frozen=True)
class Part:
    path: str  # local path, s3:// or hf:// URL (variables expanded, relative -> absolute)
    sha256: str | dict[str, str] | None = None
    files: tuple[str, ...] = ()  # fetch these names under `path` (a directory) one by one


@dataclass(frozen=True)
class FamilyManifest:
    name: str
    family: str
    parts: dict[str, Part]  # target, vq, and the optional drafter, tokenizer, neighbours
    prompt: dict[str, Any]
    sampling: SamplingConfig
    dtype: str = "float32"
    cache_dir: str | None = None
    license: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def _raw(path: str | os.PathLike) -> Any:
    p = Path(path)
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - parse errors of either format
        raise ManifestError(f"{p}: cannot parse: {e}") from None


def manifest_family(path: str | os.PathLike) -> str:
    """The family a manifest names ("llamagen" when it names none)."""
    raw = _raw(path)
    return str(raw.get("family") or "llamagen") if isinstance(raw, Mapping) else "llamagen"


def _part(raw: Any, key: str, base: Path, src: str) -> Part:
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, Mapping) or "path" not in raw:
        raise ManifestError(f"{src}: {key} must be a path or a mapping with 'path'")
    unknown = set(raw) - COMPONENT_KEYS
    if unknown:
        raise ManifestError(f"{src}: {key}: unknown fields {sorted(unknown)} (allowed: {sorted(COMPONENT_KEYS)})")
    _check_sha_field(raw.get("sha256"), f"{src}: {key}.sha256")
    files = raw.get("files") or ()
    if not isinstance(files, (list, tuple)) or not all(isinstance(f, str) and f and "/" not in f for f in files):
        raise ManifestError(f"{src}: {key}.files must be a list of file names")
    return Part(_expand(raw["path"], base, f"{src}: {key}.path"), raw.get("sha256"), tuple(files))


def read_family_manifest(path: str | os.PathLike) -> FamilyManifest:
    """Parse and validate a family manifest (no file is read or downloaded)."""
    p = Path(path)
    raw, src, base = _raw(p), str(p), p.resolve().parent
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{src}: expected a mapping at the top level")
    unknown = set(raw) - TOP_LEVEL
    if unknown:
        raise ManifestError(f"{src}: unknown fields {sorted(unknown)} (allowed: {sorted(TOP_LEVEL)})")
    try:
        family = get_family(str(raw.get("family"))).name
    except KeyError as e:
        raise ManifestError(f"{src}: {e.args[0]}") from None
    missing = [k for k in ("target", "vq") if not raw.get(k)]
    if missing:
        raise ManifestError(f"{src}: missing fields {missing}")
    parts = {k: _part(raw[k], k, base, src) for k in PARTS if raw.get(k)}
    prompt = dict(raw.get("prompt") or {})
    if raw.get("grid") is not None:
        prompt.setdefault("grid", raw["grid"])
    try:
        sampling = SamplingConfig(**(raw.get("sampling") or {}))
    except (TypeError, ValueError) as e:
        raise ManifestError(f"{src}: sampling: {e}") from None
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ManifestError(f"{src}: dtype must be one of {list(DTYPES)}, got {dtype!r}")
    lic = raw.get("license") or {}
    if not isinstance(lic, Mapping):
        raise ManifestError(f"{src}: license must be a mapping (model, model_url, ...)")
    cache_dir = _expand(raw["cache_dir"], base, f"{src}: cache_dir") if raw.get("cache_dir") else None
    return FamilyManifest(str(raw.get("name") or p.stem), family, parts, prompt, sampling, dtype, cache_dir,
                          dict(lic), src)


def _fetch(cache: LocalCache, part: Part) -> Path:
    if not part.files:
        return cache.fetch(part.path, part.sha256)
    sha = part.sha256 if isinstance(part.sha256, Mapping) else {}
    local = [cache.fetch(part.path.rstrip("/") + "/" + f, sha.get(f)) for f in part.files]
    return local[0].parent  # every file lands in one folder (the Hub snapshot's, the S3 prefix's)


def load_family_manifest(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                         s3_client_factory: Callable[[], Any] | None = None, device: str = "cpu") -> Bundle:
    """Read a family manifest, fetch its parts (S3 into the local cache, hf:// through the Hub's
    cache) and load them with the family's loaders."""
    m = read_family_manifest(path)
    cache = LocalCache(cache_dir or m.cache_dir, s3_client_factory)
    local = {k: _fetch(cache, part) for k, part in m.parts.items()}
    return build_family_bundle(m.name, m.family, local, m.prompt, m.sampling, DTYPES[m.dtype], device)
