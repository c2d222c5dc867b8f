"""ADT-Tree controller: hand-built acceptance sequences -> expected shapes; exactness of `adt`."""

import numpy as np
import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, LanternConfig, random_bundle
from adt_core.round.adaptive import AdaptiveGrid, bisect_update, shape_budget

CFG = AdaptiveConfig()  # d0 5, k0 10, beta 0.5, d in [2, 8], k in [2, 16], n in [8, 64]


class One:
    """One slot of an AdaptiveGrid: the shape (d, k) of a round starting at image index i."""

    def __init__(self, grid: tuple[int, int], cfg: AdaptiveConfig) -> None:
        self.grid, self.cfg = AdaptiveGrid(1, grid, cfg), cfg

    def shape(self, index: int) -> tuple[int, int]:
        d, k = self.grid.shapes(np.array([index]))
        return int(d[0]), int(k[0])

    def observe(self, first: int, depth: int, width: int, accepted: int) -> None:
        self.grid.observe(*(np.array([x]) for x in (first, depth, width, accepted)))


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
    c = One((4, 6), CFG)
    assert c.shape(1) == c.shape(1)  # no record yet -> defaults
    assert c.shape(1) == (5, 10)
    c.observe(1, depth=4, width=8, accepted=4)  # committed tokens 1..5 (row 0), alpha = 1
    assert c.shape(3) == (6, 5)  # left neighbour (0, 2) has alpha 1 -> deeper, narrower than (4, 8)
    # row start (1, 0): no left neighbour -> the record above, at (0, 0), is missing -> defaults
    assert c.shape(6) == (5, 10)
    c.observe(0, depth=2, width=16, accepted=0)  # token 0 recorded with alpha 0
    assert c.shape(6) == (2, 16)  # falls back to (0, 0): alpha 0 -> shallower, wider


def test_both_init_blends_the_row_above():
    b = One((3, 4), AdaptiveConfig(init="both"))
    b.observe(0, depth=4, width=8, accepted=3)  # tokens 0..3 alpha 0.75
    b.observe(4, depth=4, width=8, accepted=0)  # token 4 alpha 0
    # left (1,0) alpha 0, row above mean 0.75 -> 0.375 < beta -> shallower; from (4, 8): 4 - ceil(2/2), 8 + ceil(8/2)
    assert b.shape(5) == (3, 12)


def test_vertical_prefers_record_above():
    v = One((3, 4), AdaptiveConfig(init="vertical"))
    v.observe(0, depth=4, width=8, accepted=3)  # row 0: alpha 0.75
    v.observe(4, depth=4, width=8, accepted=0)  # (1,0): alpha 0
    assert v.shape(5) == (6, 5)  # above (0,1) alpha 0.75 -> deeper


def test_bounds_respected_over_random_sequences():
    g = torch.Generator().manual_seed(0)
    c = One((8, 8), AdaptiveConfig(mode="bisect", init="both"))
    i = 1
    while i < 63:
        d, k = c.shape(i)
        assert CFG.d_min <= d <= CFG.d_max and CFG.k_min <= k <= CFG.k_max
        assert 1 <= shape_budget(d, k, CFG) <= CFG.n_max
        a = int(torch.randint(0, d + 1, (1,), generator=g))
        c.observe(i, d, k, a)
        i += a + 1


def test_calibration_reads_this_processs_cpu_time_on_a_cpu():
    """The cost table is timed by the clock the CPU rounds are judged by: a wait (another
    process holding the core) adds nothing to it."""
    import time

    from adt_core.calibrate import Timer

    cpu, wall = Timer(torch.device("cpu"), cpu=True), Timer(torch.device("cpu"))
    c0, w0 = cpu.now(), wall.now()
    time.sleep(0.2)
    assert cpu.now() - c0 < 50.0 and wall.now() - w0 >= 200.0


def test_draft_level_cost_is_measured_once_per_generator_model():
    from adt_core.engine import _COSTS

    bundle = random_bundle(seed=4, vocab=16, grid=(4, 4))
    gen = Generator(bundle, DecodeConfig(method="adt", temperature=0.0, adaptive=AdaptiveConfig(budget="cost")))
    table = gen.cost_table()
    assert table.draft_level_ms >= 0.0 and table.cost(1) > 0
    assert gen.cost_table() is table and len(_COSTS[bundle.target]) == 1


@pytest.mark.parametrize("adaptive", [
    AdaptiveConfig(budget="shape"),
    AdaptiveConfig(budget="shape", init="vertical", mode="step"),
    AdaptiveConfig(budget="shape", init="both", d_max=6, k_max=8, n_max=32),
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
        shape = AdaptiveConfig(budget="shape")  # the same trees every run (the cost budget's follow the clock)
        base = DecodeConfig(method="adt", temperature=temp, top_k=8, cfg_scale=2.0, adaptive=shape)
        lan = DecodeConfig(method="adt", temperature=temp, top_k=8, cfg_scale=2.0, adaptive=shape,
                           lantern=LanternConfig(k=6, delta=0.0))
        a = Generator(bundle, base).generate(prompts, [3, 4])
        b = Generator(bundle, lan).generate(prompts, [3, 4])
        for x, y in zip(a, b):
            assert torch.equal(x.tokens, y.tokens)
            assert x.stats.accepted_lengths == y.stats.accepted_lengths
            assert y.stats.lossy


def test_skipped_pairs_are_never_fed_and_outputs_stay_exact(monkeypatch):
    """Plain steps the budget will not draft after store no pair (ring.skip); drafting rounds
    in between still equal ar token for token (greedy and coupled, fp32)."""
    from adt_core import DecodeConfig, Generator, random_bundle
    from adt_core.round.budget import BatchBudget
    from adt_core.round.draft import PairRing

    bundle = random_bundle(seed=3, vocab=16, grid=(4, 4))
    prompts, seeds = ["a red apple", "blue dog", "sun over hills"], [1, 2, 3]
    rounds = {"n": 0}

    def every_fifth(self, a):  # draft one round in five; plain steps in between feed nothing
        rounds["n"] += 1
        return rounds["n"] % 5 == 0

    monkeypatch.setattr(BatchBudget, "worth_drafting", every_fifth)
    monkeypatch.setattr(BatchBudget, "plain_ahead", lambda self, a, n: rounds["n"] % 5 not in (3, 4))
    monkeypatch.setattr("adt_core.round.cost_plan.VETO", 0.0)
    stores = {"n": 0}
    push_one = PairRing.push_one

    def counted(self, *a):
        stores["n"] += 1
        return push_one(self, *a)

    monkeypatch.setattr(PairRing, "push_one", counted)
    for temperature in (0.0, 1.0):
        kw = dict(batch_size=2, temperature=temperature, top_k=8)
        ref = Generator(bundle, DecodeConfig(method="ar", **kw)).generate(prompts, seeds)
        stores["n"], rounds["n"] = 0, 0
        res = Generator(bundle, DecodeConfig(method="adt", **kw)).generate(prompts, seeds)
        assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(ref, res)), temperature
        plain = sum(r.stats.target_forwards for r in res)  # an upper bound on plain steps
        assert 0 < stores["n"] < plain / 2  # only the steps right before a drafting round stored pairs
        assert sum(r.stats.draft_tokens for r in res) > 0


def test_plain_steps_pairs_stored_late_read_as_stored_at_once():
    """`PairRing.push_one` keeps a plain step's pair until the ring is read (or RING wait): what a
    catch-up gathers, after plain steps with slots idle, a drafted round's pairs and a slot that
    restarts, equals each pair stored when it was made."""
    from adt_core.round.draft import RING, PairRing

    gen = torch.Generator().manual_seed(0)
    late, now = PairRing(3, 2, 4, "cpu", torch.float32), PairRing(3, 2, 4, "cpu", torch.float32)
    count = np.array([0, 5, 9])
    for step in range(2 * RING + 7):
        hidden, tokens = torch.randn(6, 4, generator=gen), torch.randint(0, 99, (3,), generator=gen)
        active = np.array([True, step % 3 != 0, step < RING + 4])
        if step == 20:  # a drafted round: two pairs per active slot, stored at once by both
            counts = torch.from_numpy(active.astype(np.int64) * 2)
            h2, t2 = torch.randn(6, 2, 4, generator=gen), torch.randint(0, 99, (3, 2), generator=gen)
            for ring in (late, now):
                ring.push(torch.from_numpy(count), h2, t2, counts)
            count = count + counts.numpy()
            continue
        if step == 26:  # slot 0 starts a new image: its pairs restart at 0
            count[0] = 0
        late.push_one(count.copy(), hidden, tokens, active)
        col = torch.from_numpy(np.where(active, count % RING, RING))  # each pair stored as it is made
        now.t[now._slot_idx, col] = tokens
        now.h[now._row_idx, now.rows(col)] = hidden
        count = count + active
        if step in (11, 2 * RING + 6):  # (17 plain steps since the drafted round: one store at RING)
            lo = torch.from_numpy(np.maximum(count - RING, 0))
            n = torch.from_numpy(count) - lo
            a, b = late.gather(lo, n, RING), now.gather(lo, n, RING)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
