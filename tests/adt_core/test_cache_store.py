"""A Generator's KV caches kept between its calls (`kv_cache.CacheStore`): the same buffers, the same images."""

import pytest
import torch
from test_batch import COSTS, METHODS, PROMPTS, SEEDS, run

from adt_core import AdaptiveConfig, DecodeConfig, Generator, random_bundle


@pytest.mark.parametrize("temperature", [0.0, 1.1])
def test_a_generator_reuses_its_caches_across_calls_and_every_image_is_unchanged(temperature):
    """The second call of a shape takes the first call's caches (stale entries and all, a narrowed
    tail's included); another shape's call makes its own; every image is still the one AR makes
    alone (fp32; greedy and coupled)."""
    bundle = random_bundle(seed=11, vocab=24, grid=(3, 5))
    kw = dict(temperature=temperature, cfg_scale=3.0, top_k=10 if temperature else 0)
    alone = {p: run(bundle, "ar", [p], [s], batch_size=1, **kw)[0].tokens for p, s in zip(PROMPTS, SEEDS)}
    order = [4, 2, 0, 3, 1]
    for method, extra in [("ar", {})] + METHODS:
        g = Generator(bundle, DecodeConfig(method=method, batch_size=3, **kw, **extra))
        g.use_costs(COSTS)
        kept = []
        for idx in (range(5), order, [1, 3], order):  # shapes: 3 slots, 3, 2, 3
            ps, ss = [PROMPTS[i] for i in idx], [SEEDS[i] for i in idx]
            for p, r in zip(ps, g.generate(ps, ss)):
                assert torch.equal(r.tokens, alone[p]), (method, extra, list(idx), p)
            kept.append(dict(g._store._kept))
        target = id(bundle.target)
        assert kept[1][target] is kept[0][target]  # the same shape: the same buffers
        assert kept[2][target] is not kept[1][target] and kept[3][target] is not kept[1][target]
        if method in ("static", "eagle2", "adt"):
            assert kept[1][id(bundle.drafter)] is kept[0][id(bundle.drafter)]
        g.release()
        assert not g._store._kept


def test_reserve_makes_the_caches_a_full_call_then_takes():
    bundle = random_bundle(seed=12, vocab=16, grid=(4, 4))
    g = Generator(bundle, DecodeConfig(method="adt", temperature=0.0, batch_size=4,
                                       adaptive=AdaptiveConfig(budget="shape", d_max=3, k_max=3, n_max=8)))
    g.reserve(4)
    made = g._store._kept[id(bundle.target)]
    g.generate(PROMPTS, SEEDS)
    assert g._store._kept[id(bundle.target)] is made
