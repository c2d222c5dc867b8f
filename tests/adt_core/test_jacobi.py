"""method "jacobi" (adt_core/round/jacobi.py): no drafter model; exactness lives in the shared round
tests (test_batch, test_contract_round, test_forced_round, test_chameleon_round, test_engine's
chi-square, test_round's host reads), this file holds what only jacobi has."""

import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, LanternConfig, random_bundle
from adt_core.memory import GB, bundle_plan

PROMPTS = ["a red apple", "blue dog on grass", "sun"]
SEEDS = [3, 14, 15]


def test_a_bundle_without_a_drafter_runs_jacobi_and_equals_ar():
    bundle = random_bundle(seed=3, vocab=16, grid=(4, 5))
    bundle.drafter = None
    with pytest.raises(ValueError, match="needs a drafter"):
        Generator(bundle, DecodeConfig(method="eagle2"))
    for kw in (dict(temperature=0.0, cfg_scale=3.0), dict(temperature=1.0, top_k=8, cfg_scale=1.0)):
        ref = [r.tokens for r in Generator(bundle, DecodeConfig(method="ar", **kw)).generate(PROMPTS, SEEDS)]
        res = Generator(bundle, DecodeConfig(method="jacobi", batch_size=2, adaptive=AdaptiveConfig(budget="shape"),
                                             **kw)).generate(PROMPTS, SEEDS)
        assert all(torch.equal(a, r.tokens) for a, r in zip(ref, res))
        assert sum(r.stats.accepted_draft_tokens for r in res) > 0
        assert all(r.stats.draft_forwards == 0 for r in res)  # no drafter model ran


def test_memory_plan_counts_the_window_and_no_drafter_cache():
    bundle = random_bundle(seed=3, vocab=16, grid=(4, 5))
    bundle.drafter = None
    ar = bundle_plan(bundle, DecodeConfig(method="ar"), 8 * GB)
    jac = bundle_plan(bundle, DecodeConfig(method="jacobi"), 8 * GB)
    rej = bundle_plan(bundle, DecodeConfig(method="jacobi", sampler="rejection", temperature=1.0), 8 * GB)
    assert ar.window_per_image == 0 and jac.window_per_image > 0 and jac.drafter_kv_per_image == 0
    assert jac.tokens_per_row > ar.tokens_per_row  # the widest tree's headroom in the target cache
    assert rej.window_per_image > jac.window_per_image  # q rows over every code
    assert "window" in jac.line()


def test_lantern_with_the_jacobi_rejection_sampler_is_refused():
    with pytest.raises(ValueError, match="jacobi"):
        DecodeConfig(method="jacobi", lantern=LanternConfig(), sampler="rejection")


def test_the_budget_measures_a_width_only_on_a_window_its_own_rounds_filled():
    """JacobiPlanner: after a switch of width (or plain steps) the first WARM rounds update no
    gain, and a width's first warm readings are their mean (not a fifth of the way from the prior)."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import WARM, JacobiPlanner

    cfg = AdaptiveConfig()
    p = JacobiPlanner(16, cfg, AdaptiveGrid(1, (4, 4), cfg), CostTable({1: 10.0, 8: 20.0}), capacity=1)
    drafted = lambda m, accepted: _drafted(p, m, accepted, 12.0)  # noqa: E731

    for acc in (0, 0, 3, 1):  # width 4: two cold rounds, then readings 3 and 1
        drafted(4, acc)
    assert p.gain[4] == 2.0 and p.seen[4] == 2
    drafted(8, 0)  # another width: cold for it ...
    drafted(4, 0)  # ... and width 4 again: its window was filled by width 8
    assert p.gain[4] == 2.0 and 8 not in p.gain
    p.observe_plain(1, 10.0)
    for _ in range(WARM):
        drafted(4, 0)
    assert p.gain[4] == 2.0  # still cold after plain steps
    drafted(4, 5)
    assert p.gain[4] == 3.0  # the mean of 3, 1, 5


def test_jacobi_drafts_only_while_its_drafted_rounds_as_they_ran_beat_a_plain_step():
    """JacobiPlanner: whatever its model of the widths says, the drafted rounds as they ran
    (`real`: tokens per slot per charged ms) must beat a plain step; probes of a clear loser
    back off eight-fold, past PROBE_MAX while they cost at most PROBE_SHARE of the rounds."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import PROBE, PROBE_MAX, PROBE_SHARE, SHORT, JacobiPlanner

    cfg = AdaptiveConfig()
    p = JacobiPlanner(256, cfg, AdaptiveGrid(1, (16, 16), cfg), CostTable({1: 10.0, 8: 11.0}), capacity=1)
    p.observe_plain(1, 10.0)  # 0.1 tokens per ms
    p.gain = {w: 3.0 for w in p.widths}  # the model: 4 tokens for ~11 ms, a clear win
    assert p.choice() > 0
    _width4_rounds(p, [1] * 4, 20.0)  # drafted rounds as they ran: 1 token in 20 ms
    p.gain = {w: 3.0 for w in p.widths}
    assert p.real == pytest.approx(10.0 / 20.0) and p.choice() == 0  # half a plain step's rate
    p.trying, p.before, p.probe = 4, 0, PROBE  # a probe just ended and confirmed plain steps
    p._probed()
    assert p.probe == 8 * PROBE  # drafted rounds at half a plain step's rate: eight-fold
    for _ in range(3):
        p.trying, p.before = 4, 0
        p._probed()
    # past PROBE_MAX while probes cost under PROBE_SHARE: SHORT rounds losing a plain step each
    assert p.probe == int(SHORT * (1 / 0.5 - 1) / PROBE_SHARE) > PROBE_MAX


def test_jacobi_measures_a_plain_step_first_probes_drafting_briefly_and_keeps_times_when_narrowed():
    """JacobiPlanner: a decoder's first rounds are plain steps until a plain step's ms is measured
    (the first one's time, holding one-off costs, is not kept); while plain steps win, a probe of
    drafting runs SHORT rounds; a narrowed batch scales its measured times by the cost table
    instead of forgetting them (the prior then drafted the tail's first rounds at a loss)."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import SHORT, JacobiPlanner

    cfg = AdaptiveConfig()
    costs = CostTable({1: 10.0, 8: 11.0, 64: 40.0})
    p = JacobiPlanner(256, cfg, AdaptiveGrid(4, (16, 16), cfg), costs, capacity=4)
    assert p._pick() == 0 and p.base is None  # the model would draft (its prior): a plain step first
    p.observe_plain(4, 50.0)  # one-off costs
    assert p.base is None and p._pick() == 0
    p.observe_plain(4, 10.0)
    assert p.base == 10.0
    p.real, p.reals = 0.1, 5  # drafted rounds ran at a tenth of a plain step's rate
    assert p.choice() == 0
    picks = [p._pick() for _ in range(p.probe + SHORT)]
    assert picks[: p.probe - 1] == [0] * (p.probe - 1) and all(picks[p.probe - 1: -1]) and picks[-1] == 0
    assert len(picks) - picks.count(0) == SHORT  # the probe: SHORT drafted rounds
    f = costs.cost(2) / costs.cost(4)
    p.narrow(2)
    assert p.base == pytest.approx(10.0 * f) and p.real == pytest.approx(0.1) and p.choice() == 0  # (a share)


def test_jacobi_behind_at_fewer_slots_starts_behind_at_more():
    """JacobiPlanner.share: drafting far behind plain steps at 4 slots (a clear loser) is behind
    at 16 too (the same tokens per slot, a forward dearer per token): plain steps until a probe
    there measures it, at the interval reached at 4. A planner of more slots lends no such verdict."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import PROBE, SHORT, JacobiPlanner

    cfg = AdaptiveConfig()
    costs = CostTable({1: 10.0, 8: 11.0, 64: 40.0, 256: 120.0})
    make = lambda c: JacobiPlanner(256, cfg, AdaptiveGrid(c, (16, 16), cfg), costs, capacity=c)  # noqa: E731
    small = make(4)
    small.gain = {w: 3.0 for w in small.widths}  # the model alone would draft
    small.behind, small.probe = True, 8 * PROBE
    big = make(16)
    big.share(small)
    for _ in range(2):
        big.observe_plain(16, 20.0)  # base measured (the first holds one-off costs)
    assert big.behind and big.probe == 8 * PROBE and big.choice() == 0
    picks = [big._pick() for _ in range(big.probe + SHORT)]
    assert picks.count(0) == big.probe and len(picks) - picks.count(0) == SHORT  # one SHORT probe, at 8 x PROBE
    other = make(4)
    wide = make(16)
    wide.behind, wide.probe = True, 8 * PROBE
    other.share(wide)  # behind at more slots says nothing of fewer
    assert not other.behind and other.probe == PROBE


def _drafted(p, m: int, accepted: int, ms: float) -> None:
    """One drafted round of width m (one slot, 2 levels) that accepted `accepted` nodes in `ms`."""
    import numpy as np

    from adt_core.round.state import RoundOutcome, RoundPlan

    one = lambda v: np.array([v])  # noqa: E731
    outcome = RoundOutcome(one(accepted), one(2), one(m), np.zeros(3), np.zeros((2, p.cfg.n_max + 1)))
    p.observe(RoundPlan(2, 2, m, one(2), one(2), one(m)), outcome, 1, ms, 2.0)


def _width4_rounds(p, tokens, ms: float) -> None:
    """Drafted rounds of width 4 (one slot) committing `tokens` each (1 + accepted) in `ms`."""
    for t in tokens:
        _drafted(p, 4, t - 1, ms)


def test_jacobi_stops_drafting_only_once_its_drafted_rounds_are_surely_behind():
    """JacobiPlanner: `real` is a slow estimate (SLOW) with a standard error; drafting stops when
    it is SURE standard errors below a plain step's rate, not at the first dip (a round's tokens
    swing 1-5: an EMA of 0.2 stopped drafting that sustained 1.20x on the stand-in at B 1)."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import WARM, JacobiPlanner

    cfg = AdaptiveConfig()
    p = JacobiPlanner(256, cfg, AdaptiveGrid(1, (16, 16), cfg), CostTable({1: 10.0, 8: 11.0}), capacity=1)
    p.observe_plain(1, 10.0)  # a plain step: 0.1 tokens per ms
    losing = [1, 3, 1, 1, 1, 1]  # 1.33 tokens per 15 ms: 0.089 per ms, 11% behind, with a wide spread
    _width4_rounds(p, [1] * WARM + losing, 15.0)  # (a run's first WARM rounds are not read: a cold window)
    favour = lambda: (setattr(p, "gain", {w: 3.0 for w in p.widths}), setattr(p, "gain2", {}), p._gains_changed())  # noqa: E731
    favour()  # the model says draft
    assert p.real == pytest.approx(1.33 * 10 / 15, rel=0.01) and p.real < 1
    assert p.choice() > 0  # behind, but not surely: six readings of this spread prove little
    for _ in range(30):
        _width4_rounds(p, losing, 15.0)
    favour()
    assert p.real < 1 and p.choice() == 0  # 186 readings: surely behind


@pytest.mark.parametrize("before,drafts", [(0.9, True), (0.7, False)])
def test_jacobi_rechecks_a_near_stop_on_its_next_probe(before, drafts):
    """JacobiPlanner: after a stop near a tie (`real` >= CLEAR), the next probe amid plain steps
    counts the earlier estimate as RECHECK readings, so a probe running at 1.3x of a plain step
    starts drafting again (held at its full count, two readings of 1/16 each left it stopped for
    the rest of the image); a clear loser's probe moves it as little as before (`behind`)."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import SHORT, JacobiPlanner

    cfg = AdaptiveConfig()
    p = JacobiPlanner(256, cfg, AdaptiveGrid(1, (16, 16), cfg), CostTable({1: 10.0, 8: 11.0}), capacity=1)
    for _ in range(2):
        p.observe_plain(1, 10.0)  # a plain step: 0.1 tokens per ms (the first holds one-off costs)
    p.gain, p.gain2 = {w: 3.0 for w in p.widths}, {}
    p._gains_changed()  # the model says draft
    p.real, p.real2, p.reals = before, before ** 2 + 1e-4, 200  # drafted rounds ran at `before` of a plain step
    assert p.choice() == 0
    while (m := p._pick()) == 0:
        p.observe_plain(1, 10.0)
    for i in range(SHORT):  # the probe: 2 tokens per 10 / 1.3 x 2 ms
        _drafted(p, m, 1, 20.0 / 1.3)
        if i < SHORT - 1:
            assert p._pick() == m
    assert (p.choice() > 0) == drafts and p.behind == (not drafts)


def test_jacobi_models_a_width_read_few_times_optimistically():
    """JacobiPlanner.gains: a measured width's extra tokens plus SURE standard errors of its readings
    (optimism under uncertainty: a width read in a few cold probe rounds is tried again, one read
    in many rounds is taken at its mean)."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import SURE, JacobiPlanner

    cfg = AdaptiveConfig()
    p = JacobiPlanner(256, cfg, AdaptiveGrid(1, (16, 16), cfg), CostTable({1: 10.0, 8: 11.0}), capacity=1)
    _width4_rounds(p, [1, 1, 1, 3], 15.0)  # two cold rounds, then extra tokens 0 and 2
    g = dict(zip(p.widths, p.gains()))
    assert p.gain[4] == 1.0 and g[4] == pytest.approx(1.0 + SURE * 1.0 / 2 ** 0.5)
    _width4_rounds(p, [1, 3] * 100, 15.0)
    g = dict(zip(p.widths, p.gains()))
    assert g[4] - p.gain[4] < 0.2


def test_jacobi_ranks_widths_by_their_means_and_drafts_on_the_optimistic_rate():
    """JacobiPlanner.choice: the width is the best by its measured mean; SURE standard errors of
    optimism only decide whether that width drafts rather than a plain step. A wide width read in a
    few high-spread rounds (tokens 1 or 5) must not displace a steady narrower one whose mean rate
    is better (ranked by the optimistic rate, the budget ran 8-11 nodes a round on the stand-in at
    B 1 at the defaults where width 4 was the best fixed width)."""
    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import JacobiPlanner

    cfg = AdaptiveConfig()
    p = JacobiPlanner(256, cfg, AdaptiveGrid(1, (16, 16), cfg), CostTable({1: 10.0, 5: 14.0, 9: 22.0}), capacity=1)
    p.observe_plain(1, 10.0)
    p.observe_plain(1, 10.0)  # (the first holds one-off costs) a plain step: 10 ms
    _width4_rounds(p, [2] * 22, 14.0)  # width 4: gain 1.0, no spread, at the model's own ms
    for t in [1, 1, 1, 5, 1, 5]:  # width 8: two cold rounds, then gain 0 or 4 (mean 2.0, se 1.0)
        _drafted(p, 8, t - 1, 22.0)
    optimistic = dict(zip(p.widths, p.rates()[0]))
    mean = dict(zip(p.widths, p.rates(optimistic=False)[0]))
    assert max(optimistic, key=optimistic.get) == 8 and mean[4] > mean[8]  # (ranked by optimism: 8)
    assert p.best() == max(mean, key=mean.get) != 8 and p.choice() == p.best()


def _synthetic_run(scale: float, seed: int, rounds: int = 1000) -> tuple[float, float]:
    """JacobiPlanner on a synthetic clock (one slot): a plain step 10 ms +-20%; a drafted round of
    width m the table's ratio x 10 + 1 ms +-20%, committing 1 + Poisson(scale x g(m)) tokens (at most
    m extra), its first three rounds after plain steps at 0.2 / 0.55 / 0.8 of that (a cold window).
    Returns the planner's tokens per ms over the better of plain steps and the best fixed width, and
    the best fixed width's rate over a plain step's."""
    import numpy as np

    from adt_core.calibrate import CostTable
    from adt_core.round.adaptive import AdaptiveGrid
    from adt_core.round.jacobi_plan import JacobiPlanner

    table = CostTable({1: 10.0, 3: 12.0, 5: 14.5, 7: 16.0, 9: 17.5, 13: 21.0, 17: 24.0, 25: 31.0, 33: 38.0,
                       49: 52.0, 65: 66.0})
    g = {2: 0.69, 3: 0.85, 4: 1.01, 6: 1.15, 8: 1.28, 12: 1.4, 16: 1.5, 24: 1.55, 32: 1.6, 48: 1.62, 64: 1.63}
    rate = lambda m: (1 + scale * g[m]) / (table.cost(1 + m) + 1.0) if m else 0.1  # noqa: E731
    top = max(g, key=rate)
    best = top if rate(top) > rate(0) else 0
    rng = np.random.default_rng(seed)
    cfg = AdaptiveConfig()
    p = JacobiPlanner(256, cfg, AdaptiveGrid(1, (16, 16), cfg), table, capacity=1)
    tokens = ms = 0.0
    warm = 0
    for _ in range(rounds):
        p.judged = True  # (as `plan` sets it)
        m = p._pick()
        noise = 1 + 0.2 * rng.uniform(-1, 1)
        if m == 0:
            tokens, ms, warm = tokens + 1, ms + 10.0 * noise, 0
            p.observe_plain(1, 10.0 * noise)
            continue
        warm += 1
        acc = min(m, rng.poisson(scale * g[m] * (0.2, 0.55, 0.8, 1.0)[min(warm, 4) - 1]))
        t = (table.cost(1 + m) + 1.0) * noise
        tokens, ms = tokens + 1 + acc, ms + t
        _drafted(p, m, acc, t)
    return tokens / ms / rate(best), rate(top) / 0.1


def test_jacobi_budget_on_a_synthetic_clock_near_a_tie_and_where_drafting_wins():
    """Where drafting at its best width runs at 0.955x of plain steps the budget loses under 3% (mean
    of 10 seeds); where the best width runs at 1.30x it keeps over two thirds of that gain."""
    import numpy as np

    tie = [_synthetic_run(0.35, s) for s in range(10)]
    assert tie[0][1] == pytest.approx(0.955, abs=0.01)
    assert np.mean([r for r, _ in tie]) > 0.97
    win = [_synthetic_run(1.0, s) for s in range(10)]
    assert win[0][1] == pytest.approx(1.30, abs=0.01)
    assert np.mean([r for r, _ in win]) * 1.30 > 1.0 + 2 / 3 * 0.30
