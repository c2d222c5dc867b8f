"""The cost budget's round planners: trees sized by this device's measured costs.

- `adt` (budget "cost", the default; `CostPlanner`): each slot's (d, k) from the ADT-Tree
  controller (adt_core/round/adaptive.py), and
  1. whether to draft at all: `BatchBudget`'s measured rates (adt_core/round/budget.py);
  2. levels D and kept nodes M together: the pair maximising (A + expected accepted tokens) /
     (verify(A (1 + M)) + (D + 1) x a drafter forward's ms (D levels and the catch-up) + the drafted
     round's measured bookkeeping),
     expected tokens = the summed path confidences of each slot's M best candidates no deeper
     than D (learned per depth as each level's smoothed gain), calibrated by the tokens kept
     nodes actually committed;
  3. one level past the chosen depth is tried when it is the deepest learned (and every EXPLORE
     drafted rounds), so depth grows where levels pay; each slot's depth is min(its d, D);
  4. a plan the model rates clearly below a plain step (VETO) is not run, except as the guard's
     probe: a large batch on a CPU then costs what batched AR costs.
- `eagle2` with its tree unset sizes its tree with this model: adt_core/round/eagle_plan.py
  (`SizedEaglePlanner`).
- `jacobi`'s cost budget is adt_core/round/jacobi_plan.py (`JacobiPlanner`); it shares
  `RowsJudged` with these.
"""

from __future__ import annotations

import time

import numpy as np

from adt_core.calibrate import CostTable
from adt_core.config import AdaptiveConfig, DecodeConfig
from adt_core.round.adaptive import AdaptiveGrid
from adt_core.round.budget import EMA, BatchBudget, Ragged
from adt_core.round.plan import WIDTHS, Planner, ShapePlanner, bucket, fit, roomy
from adt_core.round.state import Extent, Forecasts, RoundOutcome, RoundPlan, Slots

PRIOR = 0.7  # before any drafted round: the assumed acceptance of a draft level, per level
VETO = 0.8  # a plan the model rates below this fraction of a plain step's rate is not tried (but probed)
CAL_DECAY = 0.05  # the calibration's evidence decays by this per round that drafts the depth (~20 rounds kept)
CAL_PRIOR = 1.0  # pseudo-confidence of the calibration's prior (depth j starts at depth j - 1's ratio)


def _smooth(old: float | None, x: float) -> float:
    """The EMA of a measured quantity (its first reading as is)."""
    return x if old is None else old + EMA * (x - old)


class RowsJudged:
    """A cost budget's drafted rounds judged on the rows drafting leaves (adt_core/round/budget.py
    `Ragged`) and its plain steps as at lockstep: before each round (once the plan is made) the
    decoder passes `ragged` the cached keys its forward reads beyond a lockstep batch's, and those
    of rows spread evenly over an image (`SlotTable.ragged_keys`, read only for planners with
    `reads_rows` on rounds the guard measures)."""

    reads_rows = True
    judged = True  # whether the next round is measured (`plan` decides; unmeasured rounds skip the rows' read)
    rows: Ragged

    @classmethod
    def extent(cls, config: DecodeConfig) -> Extent:
        """The widest tree, in rows with `plan.ROOM` nodes past an image's end (plans fit `Slots.room`)."""
        return roomy(super().extent(config))  # type: ignore[misc]

    def ragged(self, keys: float, full: float, lock: float = 0.0, count: int = 0) -> None:
        self.rows.now(keys, full, lock, count)

    def fresh_rows(self) -> None:
        """The rows' spread measured anew (at start, and for a narrowed batch)."""
        self.rows = Ragged(self.costs.key_ms, self.n)


class CostPlanner(RowsJudged, ShapePlanner):
    """ADT-Tree sized by this device's measured costs (budget "cost").

    Levels D and kept nodes M are chosen together, per round, as the pair with the most expected
    tokens per ms: (A + cal x A x curve_D[M]) / (cost(A (1 + M)) + (D + 1) x level ms), where curve_D[M]
    is the per-slot summed path confidence of the M best candidates of depth <= D (EAGLE-2's
    expected accepted tokens), learned per depth from the drafted rounds' pools (smoothed), and
    cal the ratio of the tokens rounds committed to what their kept nodes' confidences promised.
    Each side also pays its measured bookkeeping (`over`, `plain_over`: a round's ms beyond the
    table's forward and its levels; a drafted round's grows with its nodes as the forward does):
    on a launch-bound GPU a drafted round's scoring, tree and commit cost about a target step,
    which only a deeper tree amortises.
    A depth never drafted is tried one level past the deepest that won (and again every EXPLORE
    drafted rounds), so the tree grows where levels pay. Each slot's own depth and width stay the
    ADT-Tree controller's (adjacency init, bisection), capped by D."""

    EXPLORE = 16  # drafted rounds between tries of one level past the chosen depth
    reads_curves = True

    def __init__(self, n_tokens: int, cfg: AdaptiveConfig, grid: AdaptiveGrid, costs: CostTable, capacity: int,
                 cpu: bool = False) -> None:
        super().__init__(n_tokens, cfg, grid)
        self.costs, self.capacity = costs, capacity
        # on a CPU the rounds are compared by this process's CPU time: on a shared machine wall time
        # swings with other work, CPU time is what the round itself cost (a GPU: the synced wall time)
        self.cpu = cpu
        self._c0 = 0.0
        self.guard = BatchBudget(costs, cfg)
        self.hits = np.zeros(cfg.d_max + 2)  # (d_max + 2,) decayed sum of slots accepting depth j
        self.conf = np.zeros(cfg.d_max + 2)  # (d_max + 2,) decayed sum of kept-node confidence at depth j
        self.curves: dict[int, np.ndarray] = {}  # depth D -> (n_max + 1,) expected accepted tokens per slot, m nodes
        self.gains: dict[int, np.ndarray] = {}  # depth j -> (n_max + 1,) smoothed gain of level j over depth j - 1
        self.level_ms: float | None = None  # measured ms per drafter forward (a level, or a round's catch-up)
        self.over: float | None = None  # measured ms of a drafted round beyond its forward and levels, per
        # unit of the forward's cost ratio to a plain step's (`_grows`)
        self.plain_over: float | None = None  # measured ms of a plain step beyond its forward
        self._fwds: dict[tuple[int, int], float] = {}  # (capacity, m) -> `_fwd`
        self.drafted = 0  # drafted rounds observed
        self.seen: set[bool] = set()  # kinds of round seen once (the first of each pays one-off costs)
        self._sized: dict[tuple[int, int], tuple[int, int, float]] = {}  # (slots, width) -> `size`, until it changes
        self.forecasts = Forecasts()  # the model's claim for each drafted round against the round
        self._expects: tuple[float, float] | None = None  # this round's, made in `plan`
        self._expected: dict[int, np.ndarray] | None = None  # `expected()`, until `observe` moves it
        self.fresh_rows()  # drafted rounds judged on the rows they leave

    @classmethod
    def build(cls, config, n_tokens, grid, costs, capacity) -> "Planner":
        return cls(n_tokens, config.adaptive, grid, costs, capacity, cpu=config.device == "cpu")

    def adopt(self, earlier: "CostPlanner") -> None:
        """Start from what an earlier decoder of the same Generator and capacity learned."""
        self.guard, self.curves, self.gains = earlier.guard, earlier.curves, earlier.gains
        self.hits, self.conf = earlier.hits, earlier.conf
        self.level_ms, self.drafted, self.seen = earlier.level_ms, earlier.drafted, earlier.seen
        self.rows, self.over, self.plain_over = earlier.rows, earlier.over, earlier.plain_over
        self.forecasts = earlier.forecasts

    def share(self, other: "Planner") -> None:
        if isinstance(other, CostPlanner):
            self.guard = other.guard

    def narrow(self, capacity: int) -> None:
        """Acceptance per depth is per image and the guard's verdicts are per slot in flight: both
        stay; the verify's cost is read for `capacity` slots, the draft level's ms and the rows'
        spread re-measured."""
        self.capacity, self.level_ms, self.over, self.plain_over = capacity, None, None, None
        self._sized = {}
        self.fresh_rows()

    def _warm(self, drafted: bool) -> bool:
        """False for the first round of a kind: its time holds one-off costs, not the rate."""
        if drafted in self.seen:
            return True
        self.seen.add(drafted)
        return False

    def _cost_ms(self, round_ms: float) -> float:
        """What the round just ended cost: CPU ms since `plan` on a CPU, else the round's wall ms."""
        return (time.process_time() * 1000.0 - self._c0) if self.cpu else round_ms

    def plan(self, slots: Slots) -> RoundPlan | None:
        a = int(slots.active.sum())
        self._expects = None
        self.judged = self.guard.judges(a)
        if self.judged:
            self._c0 = time.process_time() * 1000.0
        if a == 0 or slots.held or not self.guard.worth_drafting(a):
            return None  # (held: a wave's free slots wait; a due probe waits for the refill)
        d, k = self.shapes(slots)
        if d.max(initial=0) <= 0:
            return None
        width = int(k[d > 0].max())
        sized = self._fitted(a, width, slots.room)
        if sized is None:
            return None
        levels, m, rate = sized
        self._expects = self.expects(a, width, levels, m)  # the sizing's claim for this plan
        d = np.minimum(d, levels)
        # no level keeps more than m nodes, and a node outside its level's m best has m better
        # nodes above each descendant: expanding more than m per level drafts what is never kept
        width = min(width, max(m, self.cfg.k_min))
        k = np.minimum(k, width)
        if rate < VETO * a / self.plain_ms() and not self.guard.probing(a):
            return None  # the model expects a clear loss: a plain step (the guard still probes now and then)
        return RoundPlan(int(d.max()), width, m, d, k, np.where(d > 0, m, 0))

    def _prior_rate(self, levels: int, nodes: int, width: int) -> float:
        """Modelled tokens per ms of a full batch before any drafted round: a chain-like tree whose
        j-th level is accepted with probability PRIOR ** j."""
        c = self.capacity
        expected = c * sum(PRIOR ** j for j in range(1, min(levels, nodes) + 1))
        return (c + expected) / (self._fwd(nodes) + self._draft_ms(levels, c, width))

    def _fwd(self, m: int) -> float:
        """The table's ms of a verify forward of m nodes on every slot (kept per capacity and m:
        the model reads it for every shape every round)."""
        key = (self.capacity, m)
        if key not in self._fwds:
            self._fwds[key] = self.costs.cost(self.capacity * (1 + m))
        return self._fwds[key]

    def _grows(self, m: int) -> float:
        """How a drafted round's bookkeeping grows with its nodes: as the verify forward does
        (the table's forward of C (1 + m) tokens over one of C). Both are work over the same
        (C, 1 + m) tensors: flat where launches dominate (a GPU), growing where arithmetic does
        (a CPU, where a constant charge sized larger trees and ran 1-2% slower in the four
        stand-in cells measured)."""
        return max(1.0, self._fwd(m) / self._fwd(0))

    def plain_ms(self) -> float:
        """Modelled ms of a plain step of the full batch: the table's forward and its bookkeeping."""
        return self._fwd(0) + (self.plain_over or 0.0)

    def _draft_ms(self, levels: int, a: int, width: int) -> float:
        """A round's drafting: its catch-up forward (the pairs the last round committed) and `levels`
        level forwards, each about a level's cost. Charged per level alone, a catch-up learned on
        2-3 level trees made each level 30-50% dearer and deep trees dearer than they run
        (docs/adt_tree_log.md, twenty-second session)."""
        return (levels + 1) * self._level_cost(a, width)

    def _level_cost(self, a: int, width: int) -> float:
        if self.level_ms is not None:
            return self.level_ms
        return self.costs.draft_cost(self.capacity * width)

    def _widths(self, levels: int, width: int) -> list[int]:
        """The node buckets a tree of `levels` levels of `width` children can fill."""
        hi = min(self.cfg.n_max, width + (levels - 1) * width * width)
        return [w for w in WIDTHS if w <= max(hi, 1)]

    def size(self, a: int, width: int) -> tuple[int, int, float]:
        """(D, M, rate): the levels and kept nodes with the best modelled rate (tokens per ms) for
        `a` slots; the rate is infinite before any drafted round (nothing measured yet: the
        prior's best shape is tried)."""
        if not self.curves:
            shapes = [(d, m) for d in range(1, self.cfg.d_max + 1) for m in self._widths(d, width)]
            d, m = max(shapes, key=lambda s: self._prior_rate(s[0], s[1], width))
            return d, m, float("inf")
        d, m, rate = max(self._rates(a, width), key=lambda r: r[2])
        deepest = max(self.curves)
        if d < self.cfg.d_max and (d == deepest or self.drafted % self.EXPLORE == 0):
            d += 1  # one level past the chosen depth: measured, and kept if it pays, with nodes
            m = max(m, bucket(d))  # enough for a chain to reach it (else its acceptance is never seen)
        return d, m, rate

    def _size(self, a: int, width: int) -> tuple[int, int, float]:
        """`size`, kept until what it reads changes (a drafted round's `observe`, the capacity):
        a batch whose guard says draft and whose model says no asks it every round."""
        key = (a, width)
        if key not in self._sized:
            self._sized[key] = self.size(a, width)
        return self._sized[key]

    def _fitted(self, a: int, width: int, room: int) -> tuple[int, int, float] | None:
        """`_size`'s (D, M, rate) with M cut to what the cache rows have left (`plan.fit`, `Slots.room`)
        and D to at most M; None when no tree fits."""
        levels, m, rate = self._size(a, width)
        m = fit(m, room)
        return (min(levels, m), m, rate) if m else None

    def expected(self):
        """(D, (n_max + 1,)) for every learned depth D: calibrated tokens per slot a tree of D
        levels and m nodes commits past the root. Depth j's tokens are its curve's gain times its
        calibration, at most depth j - 1's (a slot reaches depth j only through j - 1; the root's:
        1). The cap matters where the drafter is underconfident: at T 0 a depth's calibration of
        2-8 made each extra sibling look worth 2-8x its confidence, and the stand-in's B 4 model
        claimed 3.9 tokens per slot, the root's among them, from 2 levels (a 2.17x ceiling; 3 at most)."""
        cal = self.calibration()
        below = expected_at = 0.0  # curve of depth d - 1; (n_max + 1,) calibrated tokens of depth <= d
        level = 1.0  # (n_max + 1,) depth d - 1's tokens per slot (the root's: 1)
        for d, curve in sorted(self.curves.items()):
            gain = cal[d] * (curve - below)
            level = np.minimum(gain, level)
            expected_at, below = expected_at + level, curve
            yield d, expected_at

    def _rates(self, a: int, width: int, kept: bool = True):
        """(D, M, modelled tokens per ms) of every learned depth and node bucket, `a` slots
        (kept=False: the table's alone, bookkeeping not counted)."""
        over = (self.over or 0.0) if kept else 0.0  # x _grows(m): the bookkeeping of m nodes
        for d, expected_at in self.expected():
            draft = self._draft_ms(d, a, width)
            for m in self._widths(d, width):
                expected = a * expected_at[min(m, len(expected_at) - 1)]
                yield d, m, (a + expected) / (self._fwd(m) + draft + over * self._grows(m))

    def expects(self, a: int, width: int, levels: int, m: int) -> tuple[float, float] | None:
        """(tokens, ms) the model expects of a round of `levels` levels of `width` and m nodes on
        `a` slots, as `_rates` rates it (bookkeeping included); None for a depth not learned yet."""
        if self._expected is None:
            self._expected = dict(self.expected())
        expected_at = self._expected.get(levels)
        if expected_at is None:
            return None
        tokens = a * (1.0 + expected_at[min(m, len(expected_at) - 1)])
        return tokens, self._fwd(m) + self._draft_ms(levels, a, width) + (self.over or 0.0) * self._grows(m)

    def ceiling(self) -> tuple[int, int, float]:
        """(D, M, x): the tree the model rates best for a full batch at what it has measured (the
        cost table, the draft level's ms, acceptance per depth), and that rate over a plain
        step's: the cost table's ceiling, bookkeeping not counted. (0, 0, 1.0) before a drafted round."""
        c = self.capacity
        plain = c / self.costs.cost(c)
        if not self.curves:
            return 0, 0, 1.0
        d, m, rate = max(self._rates(c, self.cfg.k_max, kept=False), key=lambda r: r[2])
        return (d, m, rate / plain) if rate > plain else (0, 0, 1.0)

    def observe(self, plan: RoundPlan, outcome: RoundOutcome, slots: int, round_ms: float, draft_ms: float) -> None:
        accepted = float(outcome.accepted.sum())
        cost = self._cost_ms(round_ms)
        self._sized, self._expected = {}, None  # acceptance, costs and `drafted` move: sized anew
        self._learn_acceptance(outcome, slots)  # every round: acceptance does not depend on warm-up
        if not self._warm(True):
            return  # the first drafted round's time holds one-off costs
        self.drafted += 1
        if self._expects is not None:  # made before this round: out of sample
            self.forecasts.add(self._expects, slots + accepted, cost)
        draft_ms *= cost / max(round_ms, 1e-6)  # the draft share of the round, on the same clock
        charged = self.rows.drafted(cost, learn=not self.guard.probing(slots))  # a run's rounds teach the spread
        self.guard.observe_round(slots, True, charged, slots + int(accepted))
        per_level = draft_ms / (plan.levels + 1)  # its levels and its catch-up (`_draft_ms`)
        self.level_ms = _smooth(self.level_ms, per_level)
        extra = charged - self._fwd(plan.nodes) - draft_ms
        self.over = _smooth(self.over, extra / self._grows(plan.nodes))

    def _learn_acceptance(self, outcome: RoundOutcome, slots: int) -> None:
        levels = np.arange(1, len(outcome.level_conf))
        hits = np.zeros_like(self.hits)
        hits[levels] = (outcome.accepted[:, None] >= levels[None]).sum(0)  # slots that accepted depth j
        conf = np.zeros_like(self.conf)
        conf[levels] = outcome.level_conf[1:]
        kept = conf > 0  # depths with kept nodes this round: only they are evidence
        self.hits = np.where(kept, (1 - CAL_DECAY) * self.hits + hits, self.hits)
        self.conf = np.where(kept, (1 - CAL_DECAY) * self.conf + conf, self.conf)
        self._learn_curves(outcome.curve / max(slots, 1))

    def calibration(self) -> np.ndarray:
        """(d_max + 2,): tokens committed at depth j per unit of kept-node confidence at depth j.
        A drafter's confidence is not its acceptance (a greedy target accepts an underconfident
        argmax), and the gap grows with depth (path confidences multiply), so one factor for all
        depths would undersize deep trees. Each depth's ratio is shrunk towards the shallower one's
        by CAL_PRIOR of pseudo-confidence: one unlucky round cannot zero a depth (its nodes would
        then never be kept again to show otherwise), and a depth not yet measured takes the
        shallower ratio."""
        cal, prev = np.ones_like(self.hits), 1.0
        for j in range(1, len(cal)):
            prev = cal[j] = (self.hits[j] + CAL_PRIOR * prev) / (self.conf[j] + CAL_PRIOR)
        return np.clip(cal, 0.25, 8.0)

    def _learn_curves(self, rows: np.ndarray) -> None:
        """rows (D, n_max + 1): this round's per-slot curve of each depth. Depth 1 is smoothed as
        measured; a deeper depth j as depth j - 1's curve plus the smoothed gain of its level,
        measured within the same rounds (depths are drafted in different regions of the images,
        so their own curves would not compare)."""
        gains = self.gains
        for j, row in enumerate(rows, start=1):
            gain = row if j == 1 else row - rows[j - 2]
            old = gains.get(j)
            gains[j] = gain if old is None else old + EMA * (gain - old)
        total = np.zeros_like(rows[0])
        for j in sorted(gains):
            total = total + gains[j]
            self.curves[j] = total

    def plain_ahead(self, slots: int, rounds: int) -> bool:
        return self.guard.plain_ahead(slots, rounds)

    def holds(self, slots: int) -> bool:
        return self.guard.holds(slots)

    def observe_plain(self, slots: int, round_ms: float) -> None:
        if not self.judged:  # no comparison will read it: counted only
            self.guard.pass_round()
            return
        cost = self.rows.plain(self._cost_ms(round_ms))  # as at lockstep
        if self._warm(False):
            self.guard.observe_round(slots, False, cost, slots)
            self.plain_over = _smooth(self.plain_over, cost - self._fwd(0))

