"""ADT-Tree controller: hand-built acceptance sequences -> expected shapes; exactness of `adt`."""

import numpy as np
import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, LanternConfig, random_bundle
from adt_core.calibrate import CostTable
from adt_core.round.adaptive import AdaptiveGrid, bisect_update, shape_budget
from adt_core.round.budget import PROBE_EVERY, PROBE_RUN, BatchBudget

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


def _planner(costs, slots=1, **kw):
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.plan import CostPlanner

    cfg = AdaptiveConfig(**kw)
    return CostPlanner(256, cfg, AdaptiveGrid(slots, (16, 16), cfg), costs, slots)


def _curves(conf_by_level):
    """Per-slot curves (D, 65) of a tree whose level j holds candidates of confidence conf_by_level[j - 1]."""
    rows, pool = [], []
    for level in conf_by_level:
        pool = sorted(pool + list(level), reverse=True)
        rows.append(np.concatenate([[0.0], np.cumsum(pool + [0.0] * 64)[:64]]))
    return np.array(rows)


def test_cost_planner_sizes_levels_and_nodes_together():
    levels = [[0.9, 0.1], [0.8, 0.05], [0.6, 0.03], [0.5] + [0.01] * 7, [0.4] + [0.01] * 15] + [[0.3] + [0.01] * 31] * 3
    flat = CostTable({1: 10.0, 8: 10.0, 64: 10.0, 256: 10.0, 1024: 10.0})
    steep = CostTable({1: 10.0, 8: 80.0, 16: 160.0, 32: 320.0, 64: 640.0})
    for costs in (flat, steep):
        p = _planner(costs)
        d, m, rate = p.size(1, 8)  # before any drafted round: the prior's best shape
        assert rate == float("inf")
        assert (d, m) == ((8, 8) if costs is flat else (1, 1))  # flat: a chain as deep as allowed; steep: one node
        rows = _curves(levels)
        for j, row in enumerate(rows, start=1):
            p.curves[j] = row
        p.level_ms, p.drafted = 0.1, 1  # a cheap drafter; not an exploration round
        d, m, _ = p.size(1, 8)
        if costs is flat:
            assert d == 8 and m == 64  # verifying more is free: every level, every node
        else:
            assert d <= 3 and m <= 3  # each node costs a plain step: only the sure first levels
    p = _planner(flat)
    assert p.ceiling() == (0, 0, 1.0)  # nothing measured: no claim
    p.curves, p.level_ms = {1: _curves(levels)[0], 2: _curves(levels)[1]}, 1.0
    d, m, x = p.ceiling()
    assert d == 2 and x == pytest.approx((1 + _curves(levels)[1][m]) / 12.0 * 10.0)  # a flat verify: 10 ms + 2 levels
    d, m, _ = p.size(1, 2)
    assert m <= 6  # never more nodes than two levels of two children hold (2 + 2 x 2)


def test_cost_planner_learns_levels_from_their_gains_and_explores_one_deeper():
    from adt_core.round.state import RoundOutcome, RoundPlan

    costs = CostTable({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0, 64: 80.0})
    p = _planner(costs)
    p.seen = {True, False}  # past the first (warm-up) round of each kind
    plan = RoundPlan(3, 2, 4, np.array([3]), np.array([2]), np.array([4]))
    rows = _curves([[0.9, 0.1], [0.8, 0.05], [0.02, 0.01]])  # the third level adds almost nothing
    out = RoundOutcome(np.array([2]), np.array([3]), np.array([4]), np.array([0.0, 0.9, 0.8, 0.02]), rows)
    p.observe(plan, out, 1, round_ms=20.0, draft_ms=3.0)
    assert sorted(p.curves) == [1, 2, 3] and p.level_ms == pytest.approx(1.0)
    np.testing.assert_allclose(p.curves[3], rows[2])  # one round: the curves as measured
    for j in (1, 2, 3):  # the gains add up to each depth's curve
        np.testing.assert_allclose(sum(p.gains[i] for i in range(1, j + 1)), p.curves[j])
    p.drafted = 1  # not an exploration round
    d, m, _ = p.size(1, 2)
    assert d == 2 and 2 <= m <= 4  # the third level does not pay; two sure levels do
    p.level_ms = 0.01
    p.curves[3] = _curves([[0.9, 0.1], [0.8, 0.05], [0.7, 0.01]])[2]  # now it would
    d, _, _ = p.size(1, 2)
    assert d == 4  # the deepest learned depth wins: one level deeper is tried


def test_one_unlucky_round_does_not_zero_a_depth_and_exploring_keeps_nodes_to_reach_it():
    """The calibration is shrunk towards the shallower depth's ratio: a depth whose kept nodes
    missed once keeps a fair estimate (a zero would size every later tree without it, so it
    would never be kept to show otherwise); a tried deeper level comes with nodes to reach it."""
    from adt_core.round.plan import CAL_PRIOR, bucket
    from adt_core.round.state import RoundOutcome, RoundPlan

    p = _planner(CostTable({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0, 64: 80.0}))
    plan = RoundPlan(2, 2, 3, np.array([2]), np.array([2]), np.array([3]))
    rows = _curves([[0.5, 0.2], [0.3, 0.1]])
    p.observe(plan, RoundOutcome(np.array([1]), np.array([2]), np.array([3]), np.array([0.0, 0.7, 0.3]), rows),
              1, round_ms=20.0, draft_ms=3.0)  # depth 1 accepted, depth 2 missed: one slot, one round
    cal = p.calibration()
    assert cal[1] == pytest.approx((1 + CAL_PRIOR) / (0.7 + CAL_PRIOR))
    assert cal[2] == pytest.approx(cal[1] * CAL_PRIOR / (0.3 + CAL_PRIOR)) and cal[2] > 0.5
    assert cal[5] == cal[2]  # never measured: the deepest measured ratio
    for _ in range(60):  # depth 2 keeps missing: the evidence outweighs the prior
        p.observe(plan, RoundOutcome(np.array([1]), np.array([2]), np.array([3]), np.array([0.0, 0.7, 0.3]), rows),
                  1, round_ms=20.0, draft_ms=3.0)
    assert p.calibration()[2] < 0.3
    p.curves = {1: _curves([[0.9]])[0]}  # one level learned, one node
    p.level_ms = 0.5
    d, m, _ = p.size(1, 2)
    assert d == 2 and m >= bucket(2)  # the level past it is tried with a node to keep there


def test_batch_budget_drafts_only_while_it_measures_faster_and_probes():
    b = BatchBudget(CostTable({1: 10.0, 4: 40.0, 64: 640.0}, draft={1: 5.0, 64: 5.0}), AdaptiveConfig(), samples=1)
    assert not b.worth_drafting(4)  # no history: a plain step first
    b.observe_round(4, False, ms=20.0, tokens=4)  # 0.2 tokens/ms
    assert b.worth_drafting(4)  # then a drafted round
    b.observe_round(4, True, ms=50.0, tokens=6)  # 0.12 tokens/ms: AR wins
    decisions = []
    for _ in range(3 * PROBE_EVERY + 3 * PROBE_RUN):
        d = b.worth_drafting(4)
        decisions.append(d)
        b.observe_round(4, d, ms=50.0 if d else 20.0, tokens=6 if d else 4)
    probes = [i for i, d in enumerate(decisions) if d]
    first, second = PROBE_EVERY, PROBE_EVERY + PROBE_RUN + 2 * PROBE_EVERY
    run = lambda start: list(range(start, start + PROBE_RUN))  # noqa: E731
    assert probes == run(first) + run(second)  # probes only, each a run, the interval doubling
    assert not b.worth_drafting(5)  # 4-7 slots share one measurement
    assert not b.worth_drafting(9)  # a new bucket takes plain steps from the nearest measured one
    for _ in range(3):  # drafting got much faster (an easy region): the median of the comparisons moves,
        for _ in range(PROBE_RUN):  # the verdict is no longer sure: probes come sooner
            b.observe_round(4, True, ms=5.0, tokens=6)
        b.observe_round(4, False, ms=20.0, tokens=4)
    assert not b.sure[3] and b.probe_every < PROBE_EVERY
    for _ in range(3 * PROBE_EVERY):
        d = b.worth_drafting(4)
        b.observe_round(4, d, ms=5.0 if d else 20.0, tokens=6 if d else 4)
    assert b.worth_drafting(4)  # and turns


def test_one_slow_plain_step_does_not_start_a_run_of_drafts():
    """A shared machine slows one step now and then: a drafted round next to it looks like a win.
    The verdict is the median of the latest comparisons, each against the median of the plain
    rounds just before, so one outlier decides nothing."""
    b = BatchBudget(CostTable({1: 10.0}), AdaptiveConfig(), samples=3)
    drafted = []
    for r in range(400):
        d = b.worth_drafting(16)
        drafted.append(d)
        plain_ms = 40.0 if r == 2 else 15.0  # the first explored plain round ran beside other work
        b.observe_round(16, d, ms=35.0 if d else plain_ms, tokens=28 if d else 16)  # drafting: 0.75x
    assert drafted[:6] == [False, True, False, True, False, True] and b.gain[5] < 1.0
    assert sum(drafted[6:]) <= 8 * PROBE_RUN  # then probes only (sooner while fewer than 2 x samples comparisons: not yet sure)


def test_batch_budget_compares_adjacent_rounds_only_as_steps_grow_slower():
    """A step's cost grows along the image (attention reads every cached key): a drafted round
    measured early must not look faster than plain steps measured late. Drafting here commits
    1.44x the tokens for 1.6x a plain step's time, at every position (a 10% loss)."""
    b = BatchBudget(CostTable({1: 10.0}), AdaptiveConfig(), samples=3)
    drafted = []
    for r in range(1200):
        plain_ms = 20.0 * (1 + r / 100)  # 12x slower at the end
        d = b.worth_drafting(8)
        drafted.append(d)
        b.observe_round(8, d, ms=1.6 * plain_ms if d else plain_ms, tokens=int(8 * 1.44) if d else 8)
    assert drafted[:7] == [False, True, False, True, False, True, False] and b.gain[4] < 1.0  # explored, then plain
    assert sum(drafted[6:]) <= 10 * PROBE_RUN  # probes only (every few rounds until sure), the interval growing: 32, ..., 512


def test_wide_forwards_are_never_extrapolated_as_nearly_free():
    """Past the largest size the table grows at least at the slope from its middle size: a
    second-largest reading slowed by other work (the last segment flat) must not make a 64-slot
    batch's 64-node trees (4160 tokens) look as cheap as its 9-node ones (576)."""
    slowed = CostTable({64: 100.0, 128: 180.0, 320: 420.0, 448: 800.0, 576: 800.0})
    assert slowed.cost(4160) >= 800.0 + (800.0 - 420.0) / (576 - 320) * (4160 - 576)
    assert CostTable({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}).cost(16) == 16.0  # a linear table stays linear
    assert slowed.cost(448) == 800.0 and slowed.cost(96) == 140.0  # inside the table: as measured


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


def test_batch_budget_keeps_plain_steps_unless_drafting_wins_by_the_edge():
    from adt_core.round.budget import EDGE

    for gain, drafts in ((1.0 + (EDGE - 1) / 2, False), (EDGE + 0.02, True)):
        b = BatchBudget(CostTable({1: 10.0}), AdaptiveConfig(), samples=1)
        b.observe_round(1, False, ms=10.0, tokens=1)
        b.observe_round(1, True, ms=10.0 / gain, tokens=1)  # drafting measured `gain` times faster
        assert b.worth_drafting(1) is drafts  # a noisy near-tie keeps the step that costs what `ar` pays


def test_a_new_slot_count_takes_the_nearest_choice_and_is_measured_only_by_probes():
    from adt_core.round.draft import RING

    b = BatchBudget(CostTable({1: 10.0}), AdaptiveConfig(), samples=1)
    b.observe_round(4, False, ms=20.0, tokens=4)
    b.observe_round(4, True, ms=50.0, tokens=6)  # 4 slots: plain steps win
    seen = []
    for _ in range(PROBE_EVERY + PROBE_RUN):  # 64 slots, never measured: a draining or growing batch
        d = b.worth_drafting(64)
        seen.append(d)
        b.observe_round(64, d, ms=200.0 if d else 80.0, tokens=96 if d else 64)
    assert seen == [False] * PROBE_EVERY + [True] * PROBE_RUN  # no exploration, one probe on the schedule
    assert not b.probing(64) and b.probe_every == 2 * PROBE_EVERY  # the probe confirmed plain: the interval grew
    assert b.plain_ahead(64, RING) and not b.plain_ahead(64, b.probe_every)  # pairs are kept before a probe


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
    monkeypatch.setattr("adt_core.round.plan.VETO", 0.0)
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


@pytest.mark.parametrize("gain", [0.97, 1.03])
def test_the_call_at_break_even_costs_under_two_percent(gain):
    """Synthetic clock: drafting truly `gain` x plain steps' rate, every reading +-20% noise (and a
    slow drift of the machine's speed, common to both kinds). Over many rounds the budget's
    choices lose at most 2% against always running the better kind (mean over seeds)."""
    import numpy as np

    losses = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        b = BatchBudget(CostTable({1: 10.0}), AdaptiveConfig())
        spent = tokens = 0.0
        speed = 1.0
        for _ in range(2000):
            speed *= float(np.exp(rng.normal(0, 0.02)))
            d = b.worth_drafting(1)
            ms = 30.0 / gain if d else 10.0  # a drafted round: 3 tokens; a plain step: 1
            b.observe_round(1, d, ms * speed * rng.uniform(0.8, 1.2), 3 if d else 1)
            spent, tokens = spent + ms, tokens + (3 if d else 1)
        losses.append(1 - (tokens / spent) / (max(1.0, gain) / 10.0))
    assert float(np.mean(losses)) <= 0.02, losses


def test_a_drafted_round_is_judged_on_the_rows_drafting_leaves():
    """Synthetic clock, 4 slots: drafted rounds commit 7 tokens in 32.9 ms (0.213 per ms),
    plain steps take 20 ms (0.2 per ms). With no spread expected (a table whose rows cost
    nothing per key), drafting wins. A batch still in lockstep whose drafting would leave its
    rows 300 keys apart (0.01 ms a key: 3 ms more per round, 0.19 per ms) runs plain steps; one
    whose rows are already that far apart compares the rounds as measured (plain steps do not
    bring them back) and drafts. Outputs never depend on the call."""
    from adt_core.round.state import RoundOutcome, RoundPlan

    def verdict(keys: float, full: float) -> bool:
        """The guard's first verdict (later ones learn from these rows' true spread)."""
        p = _planner(CostTable({1: 10.0, 4: 20.0, 64: 300.0}, key_ms=0.01), slots=4)
        p.seen = {True, False}  # past the first round of each kind
        plan = RoundPlan(1, 1, 1, np.ones(4, int), np.ones(4, int), np.ones(4, int))
        out = RoundOutcome(np.array([1, 1, 1, 0]), np.ones(4, int), np.ones(4, int), np.array([0.0, 2.0]),
                           _curves([[0.5]]))
        while not p.guard.verdict:
            p.ragged(keys, full)
            if p.guard.worth_drafting(4):
                p.observe(plan, out, 4, round_ms=7 / 0.213, draft_ms=3.0)  # 7 tokens (1.75 per slot)
            else:
                p.observe_plain(4, 20.0)
        return p.guard.verdict[p.guard.bucket(4)]

    assert verdict(0.0, 0.0) is True
    assert verdict(0.0, 300.0) is False  # lockstep rows that drafting would spread
    assert verdict(300.0, 300.0) is True  # rows already spread: as measured
    assert CostTable.from_json(CostTable({1: 2.0}, key_ms=0.25).to_json()).key_ms == 0.25


def test_the_spread_drafting_leaves_is_learned_from_drafted_rounds():
    from adt_core.round.budget import Ragged

    r = Ragged(key_ms=0.5, n_tokens=20)  # decays by 2 / 20 per drafted round
    r.now(0.0, 10.0)  # nothing drafted yet: the spread continuous refill reaches is assumed
    assert r.drafted(4.0) == 4.0 + 0.5 * 10.0 and r.spread == pytest.approx(9.0)
    for _ in range(200):  # drafted rounds that leave the rows in lockstep: the charge fades
        r.now(0.0, 10.0)
        r.drafted(4.0)
    assert r.spread < 1e-6
    r.now(6.0, 10.0)  # rows spread further than drafting has left them: no credit, no charge
    assert r.drafted(4.0) == 4.0


def test_key_cost_is_the_plain_steps_growth_per_cached_key_and_row():
    from adt_core.calibrate import key_cost

    bundle = random_bundle(seed=3, vocab=16, grid=(4, 4))
    ms = key_cost(bundle.target, rows=2, slots=2, prefix_len=8, longer=40, repeats=2, warmup=1)
    assert ms >= 0.0 and np.isfinite(ms)
    assert key_cost(bundle.target, rows=2, slots=2, prefix_len=8, longer=8) == 0.0
