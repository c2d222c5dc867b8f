"""One entry point for every kind of bundle (`adt_core.load_bundle`).

A bundle directory (bundles/bundle.py for LlamaGen, bundles/family_bundle.py for families with
their own published layouts) and a manifest (bundles/manifest.py for LlamaGen's checkpoints,
bundles/family_manifest.py for a manifest naming its `family`) are formats of one thing; this
module, above all four, picks the format.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from adt_core.bundles.bundle import DEFAULT_BUNDLE, Bundle, load_bundle_dir, resolve_bundle_dir
from adt_core.bundles.deepen import deepen, split_depth
from adt_core.bundles.family_bundle import load_family_bundle
from adt_core.bundles.family_manifest import load_family_manifest, manifest_family, read_family_manifest
from adt_core.bundles.manifest import load_manifest_bundle, read_manifest


def own_layout(meta: dict) -> bool:
    """Whether a bundle.json names a family with its own published layouts (one without
    `family` is LlamaGen's own format)."""
    return meta.get("family", "llamagen") != "llamagen"


def read_any_manifest(path: str | os.PathLike):
    """Parse and validate a manifest of any family (nothing fetched)."""
    return read_manifest(path) if manifest_family(path) == "llamagen" else read_family_manifest(path)


def load_any_manifest(path: str | os.PathLike, s3_client_factory: Callable[[], Any] | None = None,
                      device: str = "cpu") -> Bundle:
    """Fetch (S3, the Hub) and load a manifest of any family."""
    if manifest_family(path) == "llamagen":
        return load_manifest_bundle(path, s3_client_factory=s3_client_factory)
    return load_family_manifest(path, s3_client_factory=s3_client_factory, device=device)


def load_bundle(name_or_path: str | Path = DEFAULT_BUNDLE, device: str = "cpu") -> Bundle:
    """Load a bundle directory, a manifest (YAML / JSON naming published checkpoints), or an
    embedded bundle by name (default: emoji16). device "meta" (families with their own layouts
    only): every file checked, no weights read."""
    base, layers = split_depth(name_or_path) if isinstance(name_or_path, str) else (name_or_path, None)
    if layers is not None and not Path(name_or_path).exists():  # NAME@N: NAME deepened (bundles/deepen.py)
        return deepen(load_bundle(base, device=device), layers)
    path = resolve_bundle_dir(name_or_path)
    if path.is_file():
        return load_any_manifest(path, device=device)
    meta = json.loads((path / "bundle.json").read_text())
    if own_layout(meta):  # another family's parts, in their own layouts
        return load_family_bundle(path, meta, device=device)
    return load_bundle_dir(path)
