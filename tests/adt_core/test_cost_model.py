"""The cost model's own accounting: its forecasts checked out of sample, a round's drafter
forwards (the catch-up and the levels) and the measured cost tables it reads."""

import numpy as np
import pytest
from test_budget import _curves, _planner

from adt_core.calibrate import CostTable


def test_the_cost_model_is_checked_on_each_round_before_it_learns_from_it():
    """`forecasts` holds, per drafted round the model sized, the tokens and ms it expected of the
    plan (made in `plan`, before the round) against what the round committed and cost; the round
    then teaches the model, and the next round is forecast from what it learned (out of sample).
    Neither the first (warm-up) round nor a depth not learned yet is counted."""
    from adt_core.round.state import RoundOutcome, Slots

    import torch

    costs = CostTable({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0, 64: 80.0})
    p = _planner(costs)
    slots = Slots.empty(1, 256, torch.device("cpu"))
    slots.active[0], slots.host_count[0] = True, 10
    levels = [[0.9, 0.1], [0.8, 0.05]]
    p.curves = {j: row for j, row in enumerate(_curves(levels), start=1)}
    p.level_ms, p.drafted, p.seen = 1.0, 1, {False}
    p.guard.worth_drafting = lambda a: True
    claims, got = [], []
    for accepted in (2, 0, 1, 2, 1, 0, 2):
        plan = p.plan(slots)
        assert plan is not None
        claim = p.expects(1, 10, plan.levels, plan.nodes)  # None: a level tried past the deepest learned
        assert (claim is None) is (plan.levels not in p.curves)
        first = True not in p.seen
        out = RoundOutcome(np.array([min(accepted, plan.levels)]), np.array([plan.levels]), np.array([plan.nodes]),
                           np.array([0.0] + [0.5] * plan.levels), _curves(levels + [[0.3]] * 6)[: plan.levels])
        p.observe(plan, out, 1, round_ms=20.0, draft_ms=2.0)
        if claim is not None and not first:
            claims.append(claim)
            got.append(1 + min(accepted, plan.levels))
    f = p.forecasts.as_dict()
    assert 2 <= f["rounds"] == len(claims) < 7  # the warm-up round and tried levels are not counted
    assert f["tokens_committed"] == sum(got) and f["tokens_expected"] == pytest.approx(sum(c[0] for c in claims))
    assert f["ms_expected"] == pytest.approx(sum(c[1] for c in claims))
    assert f["tokens_ratio"] == pytest.approx(f["tokens_committed"] / f["tokens_expected"])
    assert len(set(claims)) > 1  # each round taught the model before the next was forecast


def test_a_rounds_catch_up_is_one_drafter_forward_not_a_share_of_its_levels():
    """A round drafts with D + 1 drafter forwards: the catch-up (the pairs the last round committed)
    and D levels. A drafter whose forwards each cost 1 ms, measured on 2-level rounds (3 ms), is
    charged 6 ms for a 5-level tree (charged per level alone: 7.5 ms, and deeper trees dearer still)."""
    from adt_core.round.state import RoundOutcome, RoundPlan

    p = _planner(CostTable({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0, 64: 80.0}))
    p.seen = {True, False}
    plan = RoundPlan(2, 2, 3, np.array([2]), np.array([2]), np.array([3]))
    out = RoundOutcome(np.array([1]), np.array([2]), np.array([3]), np.array([0.0, 0.7, 0.3]), _curves([[0.5, 0.2], [0.3]]))
    for _ in range(3):
        p.observe(plan, out, 1, round_ms=20.0, draft_ms=3.0)
    assert p.level_ms == pytest.approx(1.0)
    assert p._draft_ms(5, 1, 2) == pytest.approx(6.0) and p._draft_ms(2, 1, 2) == pytest.approx(3.0)


def test_a_slowed_reading_cannot_make_a_wider_forward_look_cheaper(monkeypatch):
    """The cost table holds each size at most what any wider size read: load only adds time, so
    the lower of two disagreeing readings holds. (Measured under load, a B 4 table read 49.4 ms
    for a plain step and 40.8 for a 1-node tree on every slot; both cost planners then sized
    1-node trees.) The draft levels' table likewise."""
    from adt_core import calibrate, random_bundle

    readings = iter([28.5, 49.4, 40.8, 64.6, 1.0, 1.4, 1.2, 1.6])
    monkeypatch.setattr(calibrate, "_fastest_ms", lambda fn, timer, repeats, warmup: next(readings))
    b = random_bundle(seed=0, vocab=64, grid=(4, 4), dim=32, n_layer=1, n_head=2)
    table = calibrate.measure_target_cost(b.target, rows=2, sizes=(1, 4, 8, 12), prefix_len=8, slots=4)
    assert table.ms == {1: 28.5, 4: 40.8, 8: 40.8, 12: 64.6}
    draft = calibrate.measure_draft_cost(b.drafter, b.target.head, 2.0, 2, (1, 2, 3, 5), prefix_len=8,
                                         vocab_size=b.target.vocab.vocab_size)
    assert draft == {1: 1.0, 2: 1.2, 3: 1.2, 5: 1.6}
