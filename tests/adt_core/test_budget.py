"""The cost budget: trees sized by measured costs and acceptance (CostPlanner), the draft-or-plain
guard (BatchBudget) and its call at break-even (the rows drafting leaves: test_rows_spread.py)."""

import numpy as np
import pytest

from adt_core import AdaptiveConfig
from adt_core.calibrate import CostTable
from adt_core.round.adaptive import AdaptiveGrid
from adt_core.round.budget import PROBE_EVERY, PROBE_RUN, BatchBudget


def _planner(costs, slots=1, **kw):
    from adt_core.round.cost_plan import CostPlanner

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
    # a flat verify: 10 ms, and 2 levels and the catch-up at 1 ms each
    assert d == 2 and x == pytest.approx((1 + _curves(levels)[1][m]) / 13.0 * 10.0)
    d, m, _ = p.size(1, 2)
    assert m <= 6  # never more nodes than two levels of two children hold (2 + 2 x 2)


def test_expected_tokens_never_exceed_what_a_tree_can_commit():
    """An underconfident drafter (at T 0 its argmax is accepted far above its confidence)
    calibrates each depth at 2-8x; its extra siblings must not then count 2-8x their
    confidence: depth j commits at most what depth j - 1 does, so D levels at most D tokens."""
    levels = [[0.3, 0.2, 0.2, 0.1], [0.25, 0.1, 0.1, 0.05], [0.2] + [0.05] * 8, [0.15] + [0.04] * 15]
    p = _planner(CostTable({1: 10.0, 8: 12.0, 64: 30.0}))
    for j, row in enumerate(_curves(levels), start=1):
        p.curves[j] = row
    p.hits[1:6], p.conf[1:6] = 40.0, 5.0  # every depth accepted at 8x its kept confidence
    assert (p.calibration()[1:6] > 6).all()
    below, adds = 0.0, [np.ones(65)]
    for d, e in p.expected():
        assert (e <= d + 1e-9).all() and (np.diff(e) >= -1e-9).all()  # at most D; more nodes never fewer
        adds.append(e - below)
        assert (adds[-1] <= adds[-2] + 1e-9).all()  # depth d adds at most what depth d - 1 does
        below = e
    d, m, x = p.ceiling()
    assert x <= (1 + min(d, m)) / (p._fwd(m) + (d + 1) * p._level_cost(1, 8)) * p._fwd(0) + 1e-9


def test_cost_planner_learns_levels_from_their_gains_and_explores_one_deeper():
    from adt_core.round.state import RoundOutcome, RoundPlan

    costs = CostTable({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0, 64: 80.0})
    p = _planner(costs)
    p.seen = {True, False}  # past the first (warm-up) round of each kind
    plan = RoundPlan(3, 2, 4, np.array([3]), np.array([2]), np.array([4]))
    rows = _curves([[0.9, 0.1], [0.8, 0.05], [0.02, 0.01]])  # the third level adds almost nothing
    out = RoundOutcome(np.array([2]), np.array([3]), np.array([4]), np.array([0.0, 0.9, 0.8, 0.02]), rows)
    p.observe(plan, out, 1, round_ms=20.0, draft_ms=3.0)
    assert sorted(p.curves) == [1, 2, 3] and p.level_ms == pytest.approx(0.75)  # 3 levels and the catch-up
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
    from adt_core.round.cost_plan import CAL_PRIOR
    from adt_core.round.plan import bucket
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
    for _ in range(5 * PROBE_EVERY + 3 * PROBE_RUN):
        d = b.worth_drafting(4)
        decisions.append(d)
        b.observe_round(4, d, ms=50.0 if d else 20.0, tokens=6 if d else 4)
    probes = [i for i, d in enumerate(decisions) if d]
    first, second = PROBE_EVERY, PROBE_EVERY + PROBE_RUN + 4 * PROBE_EVERY
    run = lambda start: list(range(start, start + PROBE_RUN))  # noqa: E731
    assert probes == run(first) + run(second)  # probes only, each a run, the interval growing four-fold (a clear loss)
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


def test_three_clear_comparisons_settle_the_call_and_a_near_tie_waits_for_more():
    """Before SURE_AFTER x samples comparisons a call is sure when every comparison lies on one
    side of the tie and their median is SURE standard errors from it (emoji16 at B 64: 0.67,
    0.71, 0.86); a near tie waits for more."""
    from adt_core.round.budget import _sure

    def sure(*rates: float) -> bool:  # comparisons of rounds that commit as many tokens: time ratios alone
        return _sure([(1.0, 1.0 / r) for r in rates])

    assert sure(0.67, 0.71, 0.86) and sure(1.3, 1.4, 1.25) and sure(0.79, 0.67, 0.71, 0.91)
    assert not sure(0.9, 0.95, 0.85)  # a near tie: more comparisons first
    assert not sure(0.67, 0.71)  # fewer than `samples`
    assert not sure(0.8, 0.6, 0.7, 1.02)  # readings on both sides, before SURE_AFTER x samples


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
    assert not b.probing(64) and b.probe_every == 4 * PROBE_EVERY  # a clear loss confirmed: the interval grew
    assert b.plain_ahead(64, RING) and not b.plain_ahead(64, b.probe_every)  # pairs are kept before a probe


def test_a_comparison_counts_every_token_a_drafted_round_commits():
    """Drafted rounds of a batch of one commit 2 tokens or 1 (7 in 10 rounds: 2): drafting at
    0.9x of plain steps' rate reads 0.9x. Its rounds' median rate (2 tokens' rate) would read 1.06x
    and draft at a loss."""
    b = BatchBudget(CostTable({1: 10.0}), AdaptiveConfig(), samples=10**6)  # compare, never settle
    for i in range(240):
        b.observe_round(1, False, 10.0, 1)
        b.observe_round(1, True, 17.0 / 0.9, 2 if i % 10 < 7 else 1)
    assert b.gain[1] == pytest.approx(0.9, abs=0.05)


@pytest.mark.parametrize("gain", [0.97, 1.03])
@pytest.mark.parametrize("spread", [False, True])
def test_the_call_at_break_even_costs_under_two_percent(gain, spread):
    """Synthetic clock: drafting truly `gain` x plain steps' rate, every reading +-20% noise (and a
    slow drift of the machine's speed, common to both kinds). A drafted round commits 3 tokens,
    or (spread) 2 tokens in 7 rounds of 10 and 1 in the others, as at emoji16 B 1 at the
    defaults: a median of per-round rates reads 2 / 1.7 of the true rate. Over many rounds the
    budget's choices lose at most 2% against always running the better kind (mean over seeds)."""
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
            mean = 1.7 if spread else 3.0  # a drafted round's tokens; a plain step: 1
            ms = 10.0 * mean / gain if d else 10.0
            n = (1 if rng.random() < 0.3 else 2) if d and spread else 3 if d else 1
            b.observe_round(1, d, ms * speed * rng.uniform(0.8, 1.2), n)
            spent, tokens = spent + ms, tokens + n
        losses.append(1 - (tokens / spent) / (max(1.0, gain) / 10.0))
    assert float(np.mean(losses)) <= 0.02, losses


def test_plain_steps_far_from_a_probe_are_not_measured():
    """While plain steps win, a plain step is read (the rows' keys, the clock) only within NEAR
    rounds of the next probe of drafting: the probe compares with those alone. The others only
    count towards it, and the probe's verdict is as when every round was read."""
    from adt_core.round.budget import NEAR

    costs = CostTable({1: 10.0, 4: 20.0, 64: 300.0})

    def run(skip: bool) -> tuple[BatchBudget, int]:
        g, read = BatchBudget(costs, AdaptiveConfig()), 0
        for i in range(2000):
            judged = g.judges(4) if skip else True
            read += judged
            drafted = g.worth_drafting(4)
            if not judged:
                assert not drafted
                g.pass_round()
            else:
                g.observe_round(4, drafted, 30.0 if drafted else 20.0 + (i % 3), 5 if drafted else 4)
        return g, read

    every, _ = run(False)
    few, read = run(True)
    assert few.verdict == every.verdict == {3: False} and few.ratios == every.ratios and few.round == 2000
    assert few.probe_every == every.probe_every and few.since_probe == every.since_probe
    assert read < 2000 // 10 and len(few.ratios[3]) > 3  # ~NEAR + PROBE_RUN rounds of each probe interval


def test_measured_bookkeeping_is_amortised_by_deeper_trees():
    """A drafted round's bookkeeping beyond its forward and levels (on a launch-bound GPU about a
    target step) is measured and charged to every drafted shape, so the planner sizes deeper
    trees where it is large; the ceiling stays the table's (bookkeeping not counted)."""
    from adt_core.round.state import RoundOutcome, RoundPlan

    levels = [[0.9, 0.1], [0.8, 0.05], [0.6, 0.03], [0.5] + [0.01] * 7, [0.4] + [0.01] * 15] + [[0.3] + [0.01] * 31] * 3
    costs = CostTable({1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 16: 14.0, 64: 26.0})
    p = _planner(costs)
    for j, row in enumerate(_curves(levels), start=1):
        p.curves[j] = row
    p.level_ms, p.drafted = 4.0, 1
    shallow = p.size(1, 2)
    ceiling = p.ceiling()
    p.over = 30.0
    deep = p.size(1, 2)
    assert deep[0] > shallow[0] and p.ceiling() == ceiling
    # what is measured: a drafted round's charged ms beyond the table's forward and its levels,
    # and a plain step's beyond the table's forward
    p, plan = _planner(costs), RoundPlan(2, 2, 4, np.array([2]), np.array([2]), np.array([4]))
    out = RoundOutcome(np.array([1]), np.array([2]), np.array([4]), np.array([0.0, 0.7, 0.3]), _curves(levels[:2]))
    p.seen = {True, False}  # past the one-off first rounds
    p.observe(plan, out, 1, round_ms=40.0, draft_ms=8.0)
    grows = costs.cost(5) / costs.cost(1)  # bookkeeping grows with the nodes as the forward does
    assert p.over == pytest.approx((40.0 - costs.cost(5) - 8.0) / grows) and p.level_ms == pytest.approx(8.0 / 3)
    p.observe_plain(1, 13.0)
    assert p.plain_over == pytest.approx(3.0) and p.plain_ms() == pytest.approx(13.0)


def test_a_near_tie_still_unsure_with_a_full_window_is_probed_less_often():
    """Drafting within a few % of plain steps on a noisy clock stays unsure (`_sure`) however long
    it runs: once WINDOW comparisons are in, each probe that leaves the call as it was doubles the
    interval up to NEAR_MAX (more comparisons only replace older ones), and a probe that changes
    the call starts over at PROBE_NEAR."""
    from adt_core.round.budget import NEAR_MAX, PROBE_NEAR, WINDOW

    unsure = 0
    for seed in range(4):
        rng = np.random.default_rng(seed)
        b = BatchBudget(CostTable({1: 10.0}), AdaptiveConfig())
        intervals, probes = [], 0
        for _ in range(3000):
            d = b.worth_drafting(4)
            probes += b.verdict.get(3) is not None and d != b.verdict[3]  # a round of the losing kind
            ms = (20.0 / 0.97 if d else 10.0) * rng.uniform(0.85, 1.15)  # drafting: 2 tokens a slot at 0.97x
            b.observe_round(4, d, ms, 8 if d else 4)
            intervals.append(b.probe_every)
        if not b.sure[3]:  # (a run may still settle it: then probes back off to PROBE_MAX)
            unsure += 1
            assert len(b.ratios[3]) == WINDOW and PROBE_NEAR in intervals and NEAR_MAX in intervals
            assert max(intervals[-500:]) == NEAR_MAX
        assert probes < 3000 * 0.1, seed  # every PROBE_NEAR rounds, a probe of PROBE_RUN rounds: a fifth of them
    assert unsure >= 2
