"""The deep-target stand-in (adt_core/models/deepen.py): emoji16 with null layers appended makes
emoji16's images bit for bit (fp32), greedy and coupled, for every method, while its target
really runs and caches every layer."""

from __future__ import annotations

import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, TreeConfig, load_bundle
from adt_core.bundles.deepen import deepen, describe, split_depth

PROMPTS, SEEDS = ["a red heart", "a smiling face"], [3, 11]
METHODS = {
    "ar": dict(method="ar"),
    "static": dict(method="static", tree=TreeConfig(depth=3)),
    "eagle2": dict(method="eagle2", tree=TreeConfig(depth=4, top_k=4, budget=12)),
    "adt": dict(method="adt"),  # the cost budget: it sees the deeper target's costs, and may choose other trees
    "adt+shape": dict(method="adt", adaptive=AdaptiveConfig(budget="shape")),
}


@pytest.fixture(scope="module")
def pair():
    base = load_bundle("emoji16")
    return base, deepen(base, 8)


def test_names_and_structure(pair):
    base, deep = pair
    assert split_depth("emoji16@32") == ("emoji16", 32) and split_depth("emoji16") == ("emoji16", None)
    assert deep.name == "emoji16@8" and describe(deep.name) == "emoji16 at the depth of a 8-layer target; same images"
    assert len(deep.target.layers) == deep.target.config.n_layer == 8 and len(base.target.layers) == 6
    assert deep.target.new_cache(2, 4).k.shape[0] == 8  # every null layer writes its own KV cache
    for block in deep.target.layers[6:]:
        assert not block.attention.wo.weight.any() and not block.feed_forward.w2.weight.any()
        assert block.attention.wqkv.weight.any() and block.feed_forward.w1.weight.any()  # computed, then zeroed
    assert load_bundle("emoji16@7").target.config.n_layer == 7
    with pytest.raises(ValueError, match="< the target's own"):
        deepen(base, 4)


@pytest.mark.parametrize("temperature", [0.0, None], ids=["greedy", "coupled"])
def test_same_images_every_method(pair, temperature):
    """Every method on the stand-in == `ar` on emoji16 (which every method on emoji16 equals:
    test_coupled, test_batch): token grids, and `ar`'s decoded images (the VQ decoder runs over
    the images that finish together: other methods finish them in other groups)."""
    base, deep = pair
    run = lambda bundle, spec: Generator(bundle, DecodeConfig(batch_size=2, max_tokens=24, temperature=temperature,  # noqa: E731
                                                             **spec)).generate(PROMPTS, SEEDS)
    want = run(base, METHODS["ar"])
    for name, spec in METHODS.items():
        got = run(deep, spec)
        assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(want, got)), name
        if name == "ar":
            assert all((a.image == b.image).all() for a, b in zip(want, got))
