"""The rows drafting leaves (budget.Ragged): a drafted round judged on the spread of row lengths it
leaves, a plain step as at lockstep, the table's cost per cached key, and who reads the rows."""

import numpy as np
import pytest
from test_budget import _curves, _planner

from adt_core import AdaptiveConfig, random_bundle
from adt_core.calibrate import CostTable
from adt_core.round.budget import RUN_SPREAD


def test_a_drafted_round_is_judged_on_the_rows_drafting_leaves():
    """Synthetic clock, 4 slots: drafted rounds commit 7 tokens in 32.9 ms (0.213 per ms),
    plain steps take 20 ms (0.2 per ms). With no spread expected (a table whose rows cost
    nothing per key), drafting wins. A batch still in lockstep whose drafting would leave its
    rows 300 keys apart (0.01 ms a key: 3 ms more per round, 0.19 per ms) runs plain steps; so
    does one whose rows are already that far apart: its plain steps count as at lockstep (17 ms,
    0.235 per ms: what they cost once a wave refills together), and its drafted rounds as
    measured (the rows they leave are the rows they met). Outputs never depend on the call."""
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
    assert verdict(0.0, 300.0 / RUN_SPREAD) is False  # lockstep rows that drafting would spread
    assert verdict(300.0, 300.0 / RUN_SPREAD) is False  # rows already spread: plain steps as at lockstep
    assert verdict(300.0, 0.0) is False  # (the spread drafting leaves is learned from its rounds)
    assert CostTable.from_json(CostTable({1: 2.0}, key_ms=0.25).to_json()).key_ms == 0.25


def test_the_spread_drafting_leaves_is_learned_from_drafted_rounds():
    from adt_core.round.budget import Ragged

    r = Ragged(key_ms=0.5, n_tokens=20)  # decays by 2 / 20 per drafted round
    full = 10.0 / RUN_SPREAD
    r.now(0.0, full)  # nothing drafted yet: what a run of a few waves reaches is assumed
    assert r.drafted(4.0) == pytest.approx(4.0 + 0.5 * 10.0) and r.spread == pytest.approx(9.0)
    r.now(1.0, full)  # a probe amid plain steps (learn=False):
    assert r.drafted(4.0, learn=False) == pytest.approx(4.0 + 0.5 * 8.0) and r.spread == pytest.approx(9.0)
    r.now(0.0, 10.0)
    assert r.plain(8.0) == 8.0  # a lockstep batch's plain step: as measured
    r.now(6.0, 10.0)
    assert r.plain(8.0) == 8.0 - 0.5 * 6.0 and r.plain(4.0) == 2.0  # less the keys past lockstep (at most half)
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


def test_only_cost_budgets_read_the_rows_spread(monkeypatch):
    """`SlotTable.ragged_keys` (numpy over every slot) runs each round only for planners that
    judge rounds on it: not for ar, a hand-fixed eagle2 tree or the shape budget."""
    from adt_core import DecodeConfig, Generator, TreeConfig
    from adt_core.round.planners import planner_class
    from adt_core.round.slot_table import SlotTable

    calls = {"n": 0}
    real = SlotTable.ragged_keys

    def counted(self):
        calls["n"] += 1
        return real(self)

    monkeypatch.setattr(SlotTable, "ragged_keys", counted)
    bundle = random_bundle(seed=3, vocab=16, grid=(4, 4))
    for method, budget, tree in (("ar", "cost", TreeConfig()), ("eagle2", "cost", TreeConfig(depth=3)),
                                 ("eagle2", "cost", TreeConfig()), ("adt", "shape", TreeConfig()),
                                 ("adt", "cost", TreeConfig()), ("jacobi", "cost", TreeConfig())):
        cfg = DecodeConfig(method=method, temperature=0.0, batch_size=2, adaptive=AdaptiveConfig(budget=budget), tree=tree)
        calls["n"] = 0
        Generator(bundle, cfg).generate(["a", "b", "c"], [0, 1, 2])
        assert (calls["n"] > 0) == planner_class(cfg).reads_rows == cfg.cost_sized  # eagle2 sized for the device: yes


def test_key_costs_measure_a_wider_forwards_growth_and_travel_with_the_table():
    from adt_core.calibrate import key_costs

    bundle = random_bundle(seed=3, vocab=16, grid=(4, 4))
    one, slope = key_costs(bundle.target, rows=2, slots=2, prefix_len=8, longer=40)
    assert one >= 0.0 and slope >= 0.0 and np.isfinite(slope)
    t = CostTable({1: 2.0}, key_ms=0.25, key_slope=0.2, prefix=40)
    back = CostTable.from_json(t.to_json())
    assert (back.key_ms, back.key_slope, back.prefix) == (0.25, 0.2, 40)
    assert back.key_growth(1) == 0.25 and back.key_growth(4) == pytest.approx(0.25 * 1.6)


def test_jacobi_models_each_widths_forward_at_the_rows_length_it_runs_on():
    """JacobiPlanner._forward: at the table's prefix a width's forward is a plain step's ms times the
    table's ratio; past it, every key a lockstep batch reads adds `key_growth(1 + m)` to it (a plain
    step `key_ms`): at the stand-in's B 64 a mid-image ratio read the early rounds as cheap and the
    late ones as dear. A table of unknown prefix keeps the ratio."""
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import JacobiPlanner

    cfg = AdaptiveConfig()
    table = CostTable({4: 10.0, 8: 14.0, 16: 20.0, 64: 50.0}, key_ms=0.01, key_slope=0.25, prefix=100)
    p = JacobiPlanner(256, cfg, AdaptiveGrid(4, (16, 16), cfg), table, capacity=4)
    p.base = 6.0  # a plain step less what its keys cost: 6 + 0.01 x the keys a lockstep batch reads
    at = lambda entries: (p.rows.now(0.0, 0.0, 8 * entries, 8), p._forward(), p._base())[1:]  # noqa: E731
    fwd, base = at(100)  # 8 cache rows at the table's prefix
    assert base == pytest.approx(6.0 + 8) and np.allclose(fwd, base * p.ratios())
    later, _ = at(150)
    grow = np.array([table.key_growth(1 + m) for m in p.widths])
    assert np.allclose(later - fwd, 8 * 50 * grow)
    from dataclasses import replace

    p.costs = replace(table, prefix=0)
    fwd, base = at(150)
    assert np.allclose(fwd, base * p.ratios())
