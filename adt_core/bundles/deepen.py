"""A benchmark stand-in for a deep target: a bundle whose target has null layers appended.

What decides whether a draft tree pays is the drafter's cost against the target's: an EAGLE
drafter is one layer, the targets users bring are 30-36 layers deep (LlamaGen-XL 36,
Chameleon-7B 32, Janus-Pro-7B 30), the embedded emoji16 target 6. `deepen(bundle, layers=N)`
appends N - depth null layers to the target: copies of its own last block whose attention output
projection (`wo`) and FFN output projection (`w2`) are zero. Each null layer computes its
attention and MLP and writes its KV cache like any layer, and adds exactly 0.0 to the residual
stream (every product with a zero weight is +-0.0, and x + 0.0 == x), so the deepened bundle
makes emoji16's images bit for bit at the cost of an N-layer target.

By name: `load_bundle("emoji16@32")` (adt_core/bundles/loader.py), so job configs and
`jobs.study --bundles emoji16@32` reach it too. The engine never knows: the result is a bundle
like any other, whose `name` says what it is.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import torch

from adt_core.bundles.bundle import Bundle

_SUFFIX = re.compile(r"^(?P<base>.+)@(?P<layers>\d+)$")


def split_depth(name: str) -> tuple[str, int | None]:
    """"emoji16@32" -> ("emoji16", 32); a name without the suffix -> (name, None)."""
    m = _SUFFIX.match(str(name))
    return (m["base"], int(m["layers"])) if m else (str(name), None)


def describe(name: str) -> str:
    """How outputs name a bundle: a stand-in for what it is ("emoji16 at the depth of a 32-layer
    target; same images"), any other bundle by its name."""
    base, layers = split_depth(name)
    return name if layers is None else f"{base} at the depth of a {layers}-layer target; same images"


def _null_block(block: torch.nn.Module) -> torch.nn.Module:
    """A copy of `block` whose residual branches add exactly zero."""
    null = copy.deepcopy(block)
    outs = [m for name, m in null.named_modules() if name in ("attention.wo", "feed_forward.w2")]
    if len(outs) != 2:
        raise ValueError("deepen: the target's blocks have no attention.wo / feed_forward.w2 (a LlamaGen target is needed)")
    with torch.no_grad():
        for m in outs:
            m.weight.zero_()
    return null


def deepen(bundle: Bundle, layers: int) -> Bundle:
    """`bundle` with its target deepened to `layers` layers by null layers (same images, the cost
    of a `layers`-deep target). The target is copied; the drafter, VQ and text encoder are shared."""
    target = bundle.target
    have = len(target.layers)
    if not hasattr(target.config, "n_layer"):
        raise ValueError(f"deepen: bundle {bundle.name!r} is not a LlamaGen target")
    if layers < have:
        raise ValueError(f"deepen: {layers} layers < the target's own {have}")
    deep = copy.deepcopy(target)
    deep.layers.extend(_null_block(target.layers[-1]) for _ in range(layers - have))
    deep.config = dataclasses.replace(target.config, n_layer=layers)  # new_cache: one KV slab per layer
    return dataclasses.replace(bundle, name=f"{bundle.name}@{layers}", target=deep.eval())
