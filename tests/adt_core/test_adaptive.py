"""ADT-Tree controller: hand-built acceptance sequences -> expected shapes; exactness of `adt`."""

import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, LanternConfig, random_bundle
from adt_core.adaptive import AdaptiveController, bisect_update, shape_budget
from adt_core.budget import PROBE_EVERY, BatchBudget
from adt_core.calibrate import CostTable

CFG = AdaptiveConfig()  # d0 5, k0 10, beta 0.5, d in [2, 8], k in [2, 16], n in [8, 64]


def test_bisect_moves_halfway_to_bounds():
    assert bisect_update(5, 10, 1.0, CFG) == (7, 6)  # 5 + ceil(3/2), 10 - ceil(8/2)
    assert bisect_update(5, 10, 0.0, CFG) == (3, 13)  # 5 - ceil(3/2), 10 + ceil(6/2)
    assert bisect_update(5, 10, 0.5, CFG) == (7, 6)  # alpha == beta counts as easy


def test_repeated_updates_converge_to_bounds():
    d, k = 5, 10
    for _ in range(10):
        d, k = bisect_update(d, k, 1.0, CFG)
    assert (d, k) == (8, 2)
    for _ in range(10):
        d, k = bisect_update(d, k, 0.0, CFG)
    assert (d, k) == (2, 16)


def test_step_mode():
    cfg = AdaptiveConfig(mode="step", l_d=1, l_k=3)
    assert bisect_update(5, 10, 1.0, cfg) == (6, 7)
    assert bisect_update(2, 15, 0.0, cfg) == (2, 16)


def test_budget_rule():
    assert shape_budget(5, 10, CFG) == 50
    assert shape_budget(8, 16, CFG) == 64  # n_max
    assert shape_budget(2, 2, CFG) == 6  # capacity k + (d-1) k^2 = 6 < n_min
    assert shape_budget(3, 3, AdaptiveConfig(gamma=0.5)) == 8  # n_min


def test_horizontal_adjacency_and_row_start_fallback():
    c = AdaptiveController((4, 6), CFG)
    assert c.shape(1) == c.shape(1)  # no record yet -> defaults
    assert (c.shape(1).depth, c.shape(1).width) == (5, 10)
    c.observe(1, depth=4, width=8, accepted=4)  # committed tokens 1..5 (row 0), alpha = 1
    s = c.shape(3)  # left neighbour (0, 2) has alpha 1 -> deeper, narrower than (4, 8)
    assert (s.depth, s.width) == (6, 5)
    # row start (1, 0): no left neighbour -> the record above, at (0, 0), is missing -> defaults
    assert (c.shape(6).depth, c.shape(6).width) == (5, 10)
    c.observe(0, depth=2, width=16, accepted=0)  # token 0 recorded with alpha 0
    s = c.shape(6)  # falls back to (0, 0): alpha 0 -> shallower, wider
    assert (s.depth, s.width) == (2, 16)


def test_both_init_blends_the_row_above():
    b = AdaptiveController((3, 4), AdaptiveConfig(init="both"))
    b.observe(0, depth=4, width=8, accepted=3)  # tokens 0..3 alpha 0.75
    b.observe(4, depth=4, width=8, accepted=0)  # token 4 alpha 0
    s = b.shape(5)  # left (1,0) alpha 0, row above mean 0.75 -> 0.375 < beta -> shallower
    assert (s.depth, s.width) == (3, 12)  # from (4, 8): 4 - ceil(2/2), 8 + ceil(8/2)


def test_vertical_prefers_record_above():
    v = AdaptiveController((3, 4), AdaptiveConfig(init="vertical"))
    v.observe(0, depth=4, width=8, accepted=3)  # row 0: alpha 0.75
    v.observe(4, depth=4, width=8, accepted=0)  # (1,0): alpha 0
    s = v.shape(5)  # above (0,1) alpha 0.75 -> deeper (6, 5)
    assert (s.depth, s.width) == (6, 5)


def test_bounds_respected_over_random_sequences():
    g = torch.Generator().manual_seed(0)
    c = AdaptiveController((8, 8), AdaptiveConfig(mode="bisect", init="both"))
    i = 1
    while i < 63:
        s = c.shape(i)
        assert CFG.d_min <= s.depth <= CFG.d_max and CFG.k_min <= s.width <= CFG.k_max
        assert 1 <= s.budget <= CFG.n_max
        a = int(torch.randint(0, s.depth + 1, (1,), generator=g))
        c.observe(i, s.depth, s.width, a)
        i += a + 1


def test_batch_budget_prefers_small_trees_when_verification_is_expensive():
    conf = torch.log(torch.tensor([0.9, 0.8, 0.5, 0.1, 0.05, 0.02] + [0.01] * 58))
    flat = CostTable({1: 10.0, 8: 10.0, 64: 10.0, 256: 10.0, 1024: 10.0})
    steep = CostTable({1: 10.0, 8: 80.0, 16: 160.0, 32: 320.0, 64: 640.0})
    cfg = AdaptiveConfig()
    assert BatchBudget(flat, cfg).choose([conf], 1.0) == 64  # verifying more is free: keep everything
    assert BatchBudget(steep, cfg).choose([conf], 1.0) <= 3
    # four slots: the forward carries 4 x (1 + m) tokens, so a linear cost never pays a node
    linear = CostTable({1: 10.0, 4: 40.0, 8: 80.0, 64: 640.0, 512: 5120.0})
    assert BatchBudget(linear, cfg).choose([conf] * 4, 1.0) == 0  # a plain AR step
    assert BatchBudget(flat, cfg).choose([conf] * 4, 1.0) == 64


def test_batch_budget_drafts_only_while_it_measures_faster_and_probes():
    b = BatchBudget(CostTable({1: 10.0, 4: 40.0, 64: 640.0}, draft={1: 5.0, 64: 5.0}), AdaptiveConfig())
    assert b.worth_drafting(4)  # no history: draft once
    b.observe_round(4, True, ms=50.0, tokens=6)  # 0.12 tokens/ms
    assert not b.worth_drafting(4)  # then try a plain step
    b.observe_round(4, False, ms=20.0, tokens=4)  # 0.2 tokens/ms: AR wins
    decisions = []
    for _ in range(3 * PROBE_EVERY + 2):
        d = b.worth_drafting(4)
        decisions.append(d)
        b.observe_round(4, d, ms=50.0 if d else 20.0, tokens=6 if d else 4)
    probes = [i for i, d in enumerate(decisions) if d]
    assert probes == [PROBE_EVERY, 3 * PROBE_EVERY + 1]  # probes only, the interval doubling
    assert not b.worth_drafting(5)  # 4-7 slots share one measurement
    assert not b.worth_drafting(9)  # a new bucket starts from the nearest measured one's choice
    b.observe_round(4, True, ms=5.0, tokens=6)  # drafting got much faster (an easy region)
    b.observe_round(4, True, ms=5.0, tokens=6)
    assert b.worth_drafting(4) and b.probe_every == PROBE_EVERY
    gate = b.level_gate(4)  # a token is worth 10 ms: a level costing 5 ms needs 0.5 expected tokens
    assert gate(2, {0: 0.3, 1: 0.3}, 8) and not gate(2, {0: 0.2, 1: 0.2}, 8)


def test_min_confidence_cuts_drafting_depth():
    """Expanded paths' confidences sum to at most 1: a floor above that stops after level 1, a zero
    floor builds every level, a floor between stops somewhere between."""
    from adt_core.draft import DraftRequest, TreeProposer

    bundle = random_bundle(seed=3, vocab=16, grid=(4, 4))
    drafter, head = bundle.drafter, bundle.target.head
    dim, t = drafter.config.dim, drafter.config.cls_token_num
    hidden = torch.randn(1, t, dim, generator=torch.Generator().manual_seed(0))

    def pool(min_conf: float):
        p = TreeProposer(drafter, head, 1.0, 1, t + 64)
        p.observe(0, hidden, list(range(t)), 0)
        return p.propose({0: DraftRequest(1, t, depth=4, width=3, min_confidence=min_conf)})[0]

    full, cut, mid = pool(0.0), pool(1.5), pool(0.05)
    assert int(full.depths.max()) == 4 and int(cut.depths.max()) == 1
    assert torch.equal(pool(0.0).tokens, full.tokens)  # drafting is deterministic
    assert 1 <= int(mid.depths.max()) <= 4


def test_draft_level_cost_is_measured_once_per_generator_model():
    from adt_core.engine import _COSTS

    bundle = random_bundle(seed=4, vocab=16, grid=(4, 4))
    gen = Generator(bundle, DecodeConfig(method="adt", temperature=0.0, adaptive=AdaptiveConfig(budget="cost")))
    table = gen.cost_table()
    assert table.draft_level_ms >= 0.0 and table.cost(1) > 0
    assert gen.cost_table() is table and len(_COSTS[bundle.target]) == 1


@pytest.mark.parametrize("adaptive", [
    AdaptiveConfig(),
    AdaptiveConfig(init="vertical", mode="step"),
    AdaptiveConfig(init="both", d_max=6, k_max=8, n_max=32),
    AdaptiveConfig(budget="cost", n_min=2),
])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_adt_equals_vanilla(adaptive, cfg_scale):
    bundle = random_bundle(seed=7, vocab=16, grid=(5, 4))
    prompts = ["a", "b c"]
    ref = Generator(bundle, DecodeConfig(method="ar", temperature=0.0, cfg_scale=cfg_scale)).generate(prompts, [0, 1])
    out = Generator(bundle, DecodeConfig(method="adt", temperature=0.0, cfg_scale=cfg_scale,
                                         adaptive=adaptive)).generate(prompts, [0, 1])
    for a, b in zip(ref, out):
        assert torch.equal(a.tokens, b.tokens)
        assert b.stats.rounds and all(r.width >= adaptive.k_min for r in b.stats.rounds if r.nodes)
        assert not b.stats.lossy


def test_lantern_delta_zero_is_lossless_verification():
    bundle = random_bundle(seed=8, vocab=16, grid=(4, 4))
    prompts = ["x y", "z"]
    for temp in (0.0, 1.0):
        base = DecodeConfig(method="adt", temperature=temp, top_k=8, cfg_scale=2.0)
        lan = DecodeConfig(method="adt", temperature=temp, top_k=8, cfg_scale=2.0, lantern=LanternConfig(k=6, delta=0.0))
        a = Generator(bundle, base).generate(prompts, [3, 4])
        b = Generator(bundle, lan).generate(prompts, [3, 4])
        for x, y in zip(a, b):
            assert torch.equal(x.tokens, y.tokens)
            assert x.stats.accepted_lengths == y.stats.accepted_lengths
            assert y.stats.lossy
