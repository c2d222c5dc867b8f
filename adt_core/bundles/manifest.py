"""Bundle manifests: a YAML / JSON file naming the published checkpoints of one model family.

    name: llamagen-t2i-xl-stage1
    grid: 16                      # image tokens per side (or [H, W])
    target:  {path: s3://models/llamagen/t2i_XL_stage1_256.pt, sha256: <hex, optional>}
    drafter: {path: s3://models/lantern/llamagen_drafter/}     # optional; a directory
    vq:      {path: /models/llamagen/vq_ds16_t2i.pt}
    text_encoder: {type: t5, path: hf://google/flan-t5-xl, dtype: bfloat16}
    sampling: {temperature: 1.0, top_k: 1000, top_p: 1.0, cfg_scale: 7.5}

A component is a path string or a mapping with `path` and optional `sha256` (a hex string for
a file, or {relative file: hex} for a directory). Paths are local (relative to the manifest's
folder; ~ and $VARS expanded), s3://bucket/key or hf://<owner>/<repo>[@<revision>]/<path>
(bundles/sources.py); bundles/cache.py makes local copies (S3 into `cache_dir`, the Hub through
its own cache) and checks the sha256.

`read_manifest(path)` validates a manifest without reading any checkpoint;
`load_manifest_bundle(path)` (also reached through `adt_core.load_bundle(path)`) fetches
and loads it into a `Bundle`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from adt_core.bundles.bundle import Bundle, build_text_encoder
from adt_core.bundles.cache import LocalCache
from adt_core.bundles.sources import ManifestError, is_hf, is_s3
from adt_core.config import SamplingConfig
from adt_core.families.llamagen.drafter_weights import load_lantern_drafter
from adt_core.families.llamagen.weights import load_llamagen_gpt, load_vq

log = logging.getLogger(__name__)

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
# LlamaGen's own sampling defaults (sample_t2i.py). LANTERN's scripts use cfg 3.0, top-k 2000.
LLAMAGEN_SAMPLING = {"temperature": 1.0, "top_k": 1000, "top_p": 1.0, "cfg_scale": 7.5}
TOP_LEVEL = {"name", "grid", "target", "drafter", "vq", "text_encoder", "sampling", "cache_dir", "dtype"}
COMPONENT_KEYS = {"target": {"path", "sha256", "n_head"}, "drafter": {"path", "sha256"}, "vq": {"path", "sha256"}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Component:
    path: str  # local path, s3:// or hf:// URL, as resolved (variables expanded, relative -> absolute)
    sha256: str | dict[str, str] | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    name: str
    grid: tuple[int, int]  # (H, W) image tokens
    target: Component
    vq: Component
    drafter: Component | None
    text_encoder: dict[str, Any]  # build_text_encoder spec; its "path" may be s3:// or hf://
    sampling: SamplingConfig
    dtype: str = "float32"  # dtype the weights are loaded in (the Generator casts for decoding)
    cache_dir: str | None = None
    source: str = ""


def is_manifest_path(p: str | os.PathLike) -> bool:
    path = Path(p)
    return path.suffix.lower() in MANIFEST_SUFFIXES and path.is_file()


def _expand(value: str, base: Path, what: str) -> str:
    s = os.path.expandvars(os.path.expanduser(str(value)))
    unset = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", s)
    if unset:
        raise ManifestError(f"{what}: environment variable(s) {', '.join(sorted(set(unset)))} not set in {value!r}")
    if is_s3(s) or is_hf(s) or Path(s).is_absolute():
        return s
    return str((base / s).resolve())


def _component(raw: Any, key: str, base: Path, source: str) -> Component:
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, Mapping) or "path" not in raw:
        raise ManifestError(f"{source}: {key} must be a path or a mapping with 'path'")
    unknown = set(raw) - COMPONENT_KEYS[key]
    if unknown:
        raise ManifestError(f"{source}: {key}: unknown fields {sorted(unknown)} "
                            f"(allowed: {sorted(COMPONENT_KEYS[key])})")
    sha = raw.get("sha256")
    _check_sha_field(sha, f"{source}: {key}.sha256")
    opts = {k: v for k, v in raw.items() if k not in ("path", "sha256")}
    return Component(_expand(raw["path"], base, f"{source}: {key}.path"), sha, opts)


def _check_sha_field(sha: Any, what: str) -> None:
    hexes = [sha] if isinstance(sha, str) else list(sha.values()) if isinstance(sha, Mapping) else []
    if sha is not None and not hexes:
        raise ManifestError(f"{what}: expected a hex string or a mapping of file -> hex string")
    for h in hexes:
        if not isinstance(h, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", h):
            raise ManifestError(f"{what}: {h!r} is not a 64-digit hex sha256")


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse and validate a manifest file (no file is read or downloaded yet)."""
    p = Path(path)
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - parse errors of either format
        raise ManifestError(f"{p}: cannot parse: {e}") from None
    src, base = str(p), p.resolve().parent
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{src}: expected a mapping at the top level")
    unknown = set(raw) - TOP_LEVEL
    if unknown:
        raise ManifestError(f"{src}: unknown fields {sorted(unknown)} (allowed: {sorted(TOP_LEVEL)})")
    missing = [k for k in ("grid", "target", "vq", "text_encoder") if k not in raw]
    if missing:
        raise ManifestError(f"{src}: missing fields {missing}")
    grid = raw["grid"]
    grid = (grid, grid) if isinstance(grid, int) else tuple(grid) if isinstance(grid, (list, tuple)) else None
    if grid is None or len(grid) != 2 or not all(isinstance(g, int) and g > 0 for g in grid):
        raise ManifestError(f"{src}: grid must be a positive int or [H, W], got {raw['grid']!r}")
    te = raw["text_encoder"]
    te = {"type": "t5", "path": te} if isinstance(te, str) else dict(te or {})
    te.setdefault("type", "t5")
    if "sha256" in te:
        _check_sha_field(te["sha256"], f"{src}: text_encoder.sha256")
    for k in ("path", "model_dir"):
        if k in te:
            te[k] = _expand(te[k], base, f"{src}: text_encoder.{k}")
    sampling = {**LLAMAGEN_SAMPLING, **(raw.get("sampling") or {})}
    try:
        samp = SamplingConfig(**sampling)
    except (TypeError, ValueError) as e:
        raise ManifestError(f"{src}: sampling: {e}") from None
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ManifestError(f"{src}: dtype must be one of {list(DTYPES)}, got {dtype!r}")
    cache_dir = _expand(raw["cache_dir"], base, f"{src}: cache_dir") if raw.get("cache_dir") else None
    return Manifest(
        name=str(raw.get("name") or p.stem), grid=(int(grid[0]), int(grid[1])),
        target=_component(raw["target"], "target", base, src), vq=_component(raw["vq"], "vq", base, src),
        drafter=_component(raw["drafter"], "drafter", base, src) if raw.get("drafter") else None,
        text_encoder=te, sampling=samp, dtype=dtype, cache_dir=cache_dir, source=src,
    )


def load_manifest_bundle(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                         s3_client_factory: Callable[[], Any] | None = None) -> Bundle:
    """Read a manifest, fetch what lives in S3 or on the Hub into the local cache, and build the Bundle."""
    m = read_manifest(path)
    cache = LocalCache(cache_dir or m.cache_dir, s3_client_factory)
    dtype = DTYPES[m.dtype]
    t0 = time.perf_counter()
    target = load_llamagen_gpt(cache.fetch(m.target.path, m.target.sha256), grid=m.grid,
                               n_head=m.target.options.get("n_head"), dtype=dtype)
    tc = target.config
    drafter = None
    if m.drafter is not None:
        drafter = load_lantern_drafter(cache.fetch(m.drafter.path, m.drafter.sha256), tc, dtype=dtype)
    vq = load_vq(cache.fetch(m.vq.path, m.vq.sha256))
    spec = {k: v for k, v in m.text_encoder.items() if k != "sha256"}
    for k in ("path", "model_dir"):
        if k in spec:
            spec[k] = str(cache.fetch(spec[k], m.text_encoder.get("sha256")))
    if spec["type"] == "t5":
        spec.setdefault("max_tokens", tc.cls_token_num)
    text = build_text_encoder(spec)
    if (text.max_tokens, text.dim) != (tc.cls_token_num, tc.caption_dim):
        raise ManifestError(f"{m.source}: text encoder gives {text.max_tokens} x {text.dim} caption states, "
                            f"target expects {tc.cls_token_num} x {tc.caption_dim}")
    log.info("bundle %s loaded from %s in %.1f s", m.name, m.source, time.perf_counter() - t0)
    return Bundle(name=m.name, text_encoder=text, target=target, drafter=drafter, vq=vq, grid=m.grid,
                  sampling=m.sampling)
