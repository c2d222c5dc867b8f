"""One entry point for every kind of bundle (`adt_core.load_bundle`).

A bundle directory (models/bundle.py) and a manifest (models/manifest.py, which builds on
bundle.py) are two formats of one thing; this module, above both, picks the format.
"""

from __future__ import annotations

import json
from pathlib import Path

from adt_core.models.bundle import DEFAULT_BUNDLE, Bundle, load_bundle_dir, resolve_bundle_dir
from adt_core.models.family_bundle import load_family_bundle
from adt_core.models.manifest import load_manifest_bundle


def load_bundle(name_or_path: str | Path = DEFAULT_BUNDLE) -> Bundle:
    """Load a bundle directory, a manifest (YAML / JSON naming published checkpoints), or an
    embedded bundle by name (default: emoji16)."""
    path = resolve_bundle_dir(name_or_path)
    if path.is_file():
        return load_manifest_bundle(path)
    meta = json.loads((path / "bundle.json").read_text())
    if meta.get("family", "llamagen") != "llamagen":  # another family's parts, in their own layouts
        return load_family_bundle(path, meta)
    return load_bundle_dir(path)
