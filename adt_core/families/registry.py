"""The model families: one entry per family, the only place that names them.

A family is a folder (adt_core/families/<name>/) whose `family.py` declares a `Family`: how to
load each part from its published on-disk layout, and the capabilities the engine and the jobs
read instead of probing the models. Entries are "module:attribute" strings, imported on first
use (a lazy registry: naming a family imports nothing). `register` adds one from outside, e.g.
a family defined in a test.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from adt_core.families.contract import Decoder, Drafter, Prompter, Target


@dataclass(frozen=True)
class Family:
    """How to load each part of a family from files (paths are local directories or files), and
    what it declares. Loaders a family does not have are None (LlamaGen's bundles and manifests
    name its own config files: adt_core/bundles/bundle.py, manifest.py)."""

    name: str
    load_target: Callable[..., Target] | None = None  # (path, dtype=, device=) -> Target
    load_drafter: Callable[..., Drafter] | None = None  # (path, target, dtype=, device=) -> Drafter
    load_decoder: Callable[..., Decoder] | None = None  # (path, device=) -> Decoder
    load_prompter: Callable[..., Prompter] | None = None  # (path, **layout options) -> Prompter
    train_head: str | None = None  # jobs.train_drafter's head type for this family's drafter (None: none)


# name -> "module:attribute" naming a Family
_FAMILIES: dict[str, str | Callable[[], Family]] = {
    "llamagen": "adt_core.families.llamagen.family:FAMILY",
    "chameleon": "adt_core.families.chameleon.family:FAMILY",
    "janus": "adt_core.families.janus.family:FAMILY",
}


def register(name: str, entry: str | Callable[[], Family] | Family) -> None:
    """Add (or replace) a family: a Family, a zero-argument factory, or "module:attribute"."""
    _FAMILIES[name] = entry if not isinstance(entry, Family) else (lambda: entry)


def unregister(name: str) -> None:
    _FAMILIES.pop(name, None)


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> Family:
    if name not in _FAMILIES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(family_names())}")
    entry = _FAMILIES[name]
    if isinstance(entry, str):
        module, attr = entry.split(":")
        return getattr(importlib.import_module(module), attr)
    return entry()
