"""The jacobi method's round planner (budget "cost"): ADT-Tree's shapes, a measured node budget.

Shapes are ADT-Tree's (adt_core/round/adaptive.py): each slot's depth d and width k from the adjacent
token's round (deeper where the neighbours' drafts were accepted, wider where not), its node
budget n = gamma d k. The batch's verify width M (nodes per slot; the forward is padded to it)
comes from a model measured on this device and these images:

- tokens a slot commits in a drafted round of width m: 1 + gain[m], measured per width in the
  warm rounds of a run at that width (a window is as deep as the trees that fill it); an
  unmeasured width takes a prior (a chain accepted level by level) scaled by the measured widths'
  median ratio to the prior. The widths are ranked by these means (`best`); whether the best one
  drafts rather than a plain step counts SURE standard errors of its readings more (optimism
  under uncertainty, as a bandit's upper confidence bound: a width read in a few probe rounds is
  tried again; the bonus fades as readings accumulate);
- milliseconds of a round: a plain step's ms (`_base`) times the cost table's ratio of a
  forward of C (1 + m) tokens to one of C (C the capacity; the ratio made non-decreasing in m),
  corrected for the rows' length (`_forward`), plus the measured overhead of a drafted round
  (scoring, tree building, the carry). Only the table's shape is used: it is timed once (on a
  CPU by this process's CPU time, as the rounds are) on rows of its `prefix`. A plain step's ms
  is measured (`base`) and follows the images' growth since at the table's cost per cached key
  (`key_ms` x the keys a lockstep batch reads): at the stand-in's B 64 on a CPU a plain step
  grows from ~120 to ~360 ms over an image, and a drafted round of width 3 from ~460 to ~730 ms
  (its 4 queries a row read each key once per block: 1.7x a plain step's growth, not 4x), so a
  ratio taken mid-image misreads the early rounds as dear and the late ones as cheap, and an
  overhead or a drafted rate held in ms, or a plain step read at one length and a drafted round
  at another, misread drafting by a third. A decoder's first rounds are plain steps that
  measure it (the first one's time, holding one-off costs, is not kept), and while drafting
  wins one plain step every PLAIN_EVERY rounds keeps it measured; a narrowed batch scales it by
  the table until measured again.

M is the width bucket with the best modelled rate at the means; the round drafts when its optimistic
rate beats a plain step's modelled rate by EDGE, and until the drafted rounds as they ran (`real`,
from a run's warm rounds: the stop is for a run that goes on) are SURE standard errors behind a
plain step (a sequential test: a drafted round's tokens swing 1-5 around ~2, and stopping at the
first dip, then paying the next probe's cold window, held the stand-in at B 1 at 1.01-1.07x where
every fixed width reached 1.13-1.20x). Readings are slow (SLOW: the mean of the first 16, then an
EMA). Every `probe` rounds a neighbour of the best width (one bucket wider or narrower, in turn)
runs RUN rounds, or, while plain steps win, the best width SHORT rounds; the interval doubles (to
PROBE_MAX) while probes leave the choice as it was, so a change (an easier region, fewer images in
flight) is noticed. While drafted rounds run at under CLEAR of a plain step's rate the interval
grows eight-fold and the next probe is SHORT rounds, up to PROBE_MAX or, past it, to where the
probes cost PROBE_SHARE of the rounds. After a near stop (drafted rounds at CLEAR or better) a
probe's readings count against the earlier estimate as against RECHECK readings: that evidence is of
a region the image has left.

Why not adt's `BatchBudget` verdict: a Jacobi window holds predictions only while rounds verify
it (a plain step predicts nothing past its root), so one-round alternation would compare drafted
rounds over a cold window, and a losing verdict would never see a warm one. The first WARM
rounds at a width, after plain steps or rounds of another width, update no gain for the same
reason (the window holds what shallower or deeper trees predicted), and a width's first
readings are averaged, not pulled from the prior (an estimate that starts at the prior and
moves a fifth of the way per reading stayed at a third of a width's sustained gain). Outputs never
depend on any of this (greedy and coupled exactness).
"""

from __future__ import annotations

import time

import numpy as np

from adt_core.round.adaptive import AdaptiveGrid, shape_budget
from adt_core.round.budget import EDGE, EMA, SURE
from adt_core.calibrate import CostTable
from adt_core.config import AdaptiveConfig
from adt_core.round.cost_plan import RowsJudged
from adt_core.round.plan import Planner, ShapePlanner, fit
from adt_core.round.state import RoundOutcome, RoundPlan, Slots

WIDTHS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # verify widths the model weighs, cut to adaptive.n_max
PRIOR = 0.7  # the prior's acceptance of a chain's first level (the j-th: PRIOR^j)
RUN = 8  # drafted rounds of a probe of another width while drafting wins
SHORT = 4  # drafted rounds of a probe of drafting while plain steps win, or after a probe that ran far behind
# plain steps (WARM cold ones, two measured; `real` carries the readings of earlier probes)
WARM = 2  # drafted rounds of a width, after plain steps or another width, that update no gain
# (the window still holds what rounds of another depth, or none, predicted)
PROBE, PROBE_MAX = 8, 256
CLEAR = 0.8  # drafted rounds this far behind a plain step's rate: probes back off eight-fold (else two-fold)
PROBE_SHARE = 0.005  # past PROBE_MAX, a clear loser's probes may cost at most this share of the rounds:
# a probe's SHORT rounds each lose 1 / ratio - 1 plain steps (at a ratio of 0.5, ~4 steps a probe: one every
# ~800 rounds; at emoji16 B 16 at the defaults probes every 256 rounds cost ~1.5% of a run)
JUDGE = 8  # plain steps the model chose are measured (`base`, the rows' read) only this close to a probe: the
# EMA reads ~5 rounds, and unmeasured ones skip ~70 us of a 4.7 ms plain step at emoji16 B 4 on a CPU
SLOW = 1 / 16  # a drafted round's weight in `gain`, `real` and `over` past their first 16 readings (the mean of
# those): a round's extra tokens swing 0-4 around ~1 on the stand-in at B 1 (the defaults), and an EMA of 0.2 let a
# few cold or unlucky rounds stop drafting that sustained 1.20x (`jacobi@4`) at 1.01-1.07x
PLAIN_EVERY = 48  # drafted rounds between plain steps that measure `base` while drafting wins
RECHECK = 4  # readings `real` counts as when a probe of drafting starts amid plain steps after a near stop (`real`
# >= CLEAR): the probe's own readings then move it as a run's first ones do (held at its full count, a probe's two
# readings moved it by 1/16 each and a stop made in one region of an image outlived the image: the stand-in at B 1,
# the defaults, drafted 1-2% of the rounds of two images after a stop in the one before, where a run drafting 98% of
# them read 1.81 tokens a round). A clear loser's probes keep their small weight: emoji16 at B 1, the defaults, where
# no tree pays, drafted 5.2% of its rounds with every probe rechecked, 1.8% without. Interleaved with `ar` and the
# old rule in one process (the stand-in, the defaults, two passes): B 1 1.09x / 1.15x against 1.05x / 1.08x (drafted
# 72-80% against 23-28%), B 4 1.06x / 1.04x against 1.01x / 0.98x, B 16 1.00x / 0.96x against 0.99x / 0.99x


class JacobiPlanner(RowsJudged, ShapePlanner):
    """ADT-Tree's per-slot shapes with the verify width from a measured cost model."""

    def __init__(self, n_tokens: int, cfg: AdaptiveConfig, grid: AdaptiveGrid, costs: CostTable, capacity: int,
                 cpu: bool = False) -> None:
        super().__init__(n_tokens, cfg, grid)
        self.costs, self.capacity, self.cpu = costs, capacity, cpu
        self.widths = tuple(m for m in WIDTHS if m <= cfg.n_max) or (cfg.n_max,)
        self.gain: dict[int, float] = {}  # width -> measured extra tokens per slot and round
        self.seen: dict[int, int] = {}  # width -> warm rounds measured (the mean of the first 1 / SLOW)
        self.gain2: dict[int, float] = {}  # width -> the same readings squared (their spread)
        self.last, self.same = 0, 0  # the last round's width, and drafted rounds in a row at it
        self.base: float | None = None  # measured ms of a plain step, less key_ms x the keys it read (`_base`)
        self.over: float | None = None  # measured ms of a drafted round beyond the model's forward (`_forward`)
        self.drafted = 0  # drafted rounds since the last plain step
        self._ratio: dict[int, np.ndarray] = {}  # capacity -> (W,) `ratios`
        self._gains: tuple | None = None  # (W,) `gains`, optimistic and at the means, until a gain changes
        self._chosen: tuple | None = None  # (what `choice` read, its width)
        self.real: float | None = None  # drafted rounds' measured tokens per slot and charged ms over a plain
        # step's rate when each ran (smoothed)
        self.reals = 0  # readings in `real`
        self.real2: float | None = None  # the same readings squared (their spread)
        self.run = 0  # drafted rounds in a row so far
        self.left, self.trying = 0, 0  # probe rounds left, and the probed width
        self.flip = 1  # the next probe's direction
        self.behind = False  # the last probe ran far behind plain steps: the next one is SHORT
        self.before = 0  # the model's choice when the last probe started
        self.idle, self.probe = 0, PROBE  # plain rounds since the last drafted one; the probe interval
        self.plains = 0  # plain steps observed (the first one's time holds one-off costs)
        self.fresh_rows()  # drafted rounds judged on the rows they leave
        self._c0 = 0.0

    @classmethod
    def build(cls, config, n_tokens, grid, costs, capacity) -> Planner:
        return cls(n_tokens, config.adaptive, grid, costs, capacity, cpu=config.device == "cpu")

    def adopt(self, earlier: "JacobiPlanner") -> None:
        """Start from what an earlier decoder of the same Generator and capacity measured (its
        round times only while it still ran that many slots: a narrowed tail's are of fewer)."""
        self.gain, self.probe, self.seen = dict(earlier.gain), earlier.probe, dict(earlier.seen)
        self.gain2 = dict(earlier.gain2)
        self.behind = earlier.behind
        self._gains_changed()
        if earlier.capacity == self.capacity:
            self.base, self.over, self.rows, self.real = earlier.base, earlier.over, earlier.rows, earlier.real
            self.real2, self.reals = earlier.real2, earlier.reals

    def share(self, other) -> None:
        """Another capacity's planner of the same Generator: its extra tokens per width are per
        slot and hold here too; round times are of another batch and are measured again. Where
        drafting ran far behind plain steps at fewer slots (`behind`), it is behind here too (the
        same tokens per slot for a forward that costs more per token as the batch widens, on a CPU
        and on a GPU alike): plain steps until a probe here says otherwise, probed as rarely as
        there (emoji16 B 16 at the defaults drafted 10 of its 14 rounds in the first 80 rounds,
        at 0.6 of a plain step's rate, after the warm-up at 4 slots had found that)."""
        if isinstance(other, JacobiPlanner):
            self.gain, self.seen, self.gain2 = dict(other.gain), dict(other.seen), dict(other.gain2)
            self._gains_changed()
            if other.behind and other.capacity <= self.capacity:
                self.behind, self.probe = True, other.probe

    def narrow(self, capacity: int) -> None:
        """Extra tokens per width are per slot: they stay. A round's times scale by the table's
        plain step of `capacity` slots over one of the old capacity, until measured again (forgotten,
        the model's prior drafted the narrowed tail's first RUN rounds at a loss where drafting lost)."""
        f = self.costs.cost(capacity) / max(self.costs.cost(self.capacity), 1e-9)
        self.base, self.over = (None if x is None else x * f for x in (self.base, self.over))
        self.capacity = capacity  # (`real` is a share of a plain step's rate)
        self.fresh_rows()

    # ---- the model ------------------------------------------------------------------------
    def ratios(self) -> np.ndarray:
        """(W,) the table's forward of C (1 + m) tokens over one of C for each width m, made
        non-decreasing in m (kept per capacity: the model reads it every round)."""
        c = self.capacity
        if c not in self._ratio:
            r = [self.costs.cost(c * (1 + w)) / self.costs.cost(c) for w in self.widths]
            self._ratio[c] = np.maximum.accumulate(np.maximum(r, 1.0))
        return self._ratio[c]

    def _base(self) -> float:
        """A plain step's ms now: measured (with its growth since at key_ms per key a lockstep batch
        reads), else the cost table's."""
        if self.base is None:
            return self.costs.cost(self.capacity)
        return max(self.base + self.costs.key_ms * self.rows.lock, 1e-3)

    def _forward(self) -> np.ndarray:
        """(W,) modelled ms of each width's verify forward now: a plain step's (`_base`) times the
        table's ratio, less what that ratio charges the keys past (or short of) the table's prefix,
        plus what a forward of 1 + m tokens a row pays for them (`CostTable.key_growth`). A table
        of unknown prefix, or keys that cost nothing, leave the ratio as it is."""
        r, c = self.ratios(), self.costs
        fwd = self._base() * r
        if c.prefix and c.key_ms and self.rows.count:
            ahead = self.rows.lock - self.rows.count * c.prefix  # keys a lockstep batch reads past the table's
            grow = np.array([c.key_growth(1 + w) for w in self.widths]) - c.key_ms * r
            fwd = np.maximum(fwd + ahead * grow, 0.5 * fwd)
        return fwd

    def prior(self, m: int) -> float:
        """Extra tokens of width m under the prior: a chain whose j-th level is accepted w.p. PRIOR^j."""
        return sum(PRIOR ** j for j in range(1, min(m, self.cfg.d_max) + 1))

    def _gains_changed(self) -> None:
        """`gains` and the choice made from them are computed anew."""
        self._gains = self._chosen = None

    def gains(self, optimistic: bool = True) -> np.ndarray:
        """(W,) modelled extra tokens per slot of each width: measured, else the prior scaled by
        the measured widths' median ratio to it (kept until a width's gain is measured again);
        optimistic: a measured width's plus SURE standard errors of its readings."""
        if self._gains is None:
            ratios = sorted(g / self.prior(w) for w, g in self.gain.items())
            scale = ratios[len(ratios) // 2] if ratios else 1.0
            up = np.array([SURE * _se(self.gain[w], self.gain2.get(w), self.seen.get(w, 0)) if w in self.gain else 0.0
                           for w in self.widths])
            mean = np.array([self.gain[w] if w in self.gain else self.prior(w) * scale for w in self.widths])
            self._gains = (mean + up, mean)
        return self._gains[0 if optimistic else 1]

    def rates(self, optimistic: bool = True) -> tuple[np.ndarray, float]:
        """Modelled tokens per ms per slot: (W,) of each width, and of a plain step (one numpy
        pass a round: the planner runs on the host before every round, plain ones included)."""
        base = self._base()
        gains = self.gains(optimistic)
        return (1 + gains) / np.maximum(self._forward() + (self.over or 0.0), 1e-3), 1.0 / base

    def choice(self) -> int:
        """The width the model rates best (0: a plain step wins). The model must also be borne
        out: drafted rounds as they ran (`real`: their tokens per charged ms, cold windows and
        the rows' spread included) must have beaten a plain step, or plain steps run (and the
        probes measure drafting again)."""
        if self.real is None and self.behind:
            return 0  # behind at fewer slots (`share`), not yet measured here
        key = (self._base(), self.over, self.real, self.capacity)  # (and the gains: `_gains_changed`)
        if self._chosen is None or self._chosen[0] != key:  # (the model runs every round: at B 1 ~20 us of a 3.3 ms
            self._chosen = (key, self._choose())  # emoji16 round, redone only when what it reads changed)
        return self._chosen[1]

    def _choose(self) -> int:
        if self.real is not None and self.real + SURE * self._real_se() <= EDGE:
            return 0
        m = self.best()
        rates, plain = self.rates()
        return m if rates[self.widths.index(m)] > EDGE * plain else 0

    def _real_se(self) -> float:
        """The standard error of `real` (its readings' spread over the readings it holds)."""
        return 0.0 if self.real is None else _se(self.real, self.real2, self.reals)

    def best(self) -> int:
        """The width the model rates best among drafted rounds, by its measured means: ranked by the
        optimistic rates, a wide width read in a few rounds of high spread displaced a steady narrower
        one (the stand-in at B 1 at the defaults ran 8-11 nodes a round where width 4 is the best
        fixed width; on the synthetic clock of tests/adt_core/test_jacobi.py the optimistic ranking
        kept 0.2-1.2% less of the best fixed width's rate in six settings)."""
        return self.widths[int(np.argmax(self.rates(optimistic=False)[0]))]

    def _pick(self) -> int:
        """This round's width: a probe's, a plain step measuring `base`, else the model's."""
        if self.left > 0:
            self.left -= 1
            return self.trying
        if self.base is None:  # plain steps first: drafted rounds are judged against a measured one from
            return 0  # their first warm round on (drafting for `base` later ran RUN rounds at a loss where it loses)
        m = self.choice()
        if m > 0 and self.drafted >= PLAIN_EVERY:
            return 0  # a plain step measures `base`
        self.idle += 1
        if self.idle < self.probe:
            self.judged = m > 0 or self.idle + JUDGE >= self.probe
            return m
        self.idle, self.before = 0, m
        best = self.best()
        i = self.widths.index(best) + (self.flip if m else 0)
        self.flip = -self.flip
        self.trying = self.widths[i] if 0 <= i < len(self.widths) else best
        self.left = (SHORT if self.behind or not m else RUN) - 1  # drafting tried while plain steps win: SHORT
        if not m and self.real is not None and self.real >= CLEAR:  # a near stop's evidence is as old as the plain
            self.reals = min(self.reals, RECHECK)  # steps since: it counts as RECHECK readings (a clear one keeps all)
        return self.trying

    # ---- planner interface ------------------------------------------------------------------
    def plan(self, slots: Slots) -> RoundPlan | None:
        self.judged = True  # (`_pick`: not the plain steps the model chose far from a probe)
        if not slots.active.any() or slots.held:
            self._c0 = time.process_time() * 1000.0
            return None  # (held: a wave's free slots wait for the rest of it; a probe waits for the refill)
        pick = self._pick()
        if self.judged:  # the round's cost counts from here (an unmeasured plain step reads no clock)
            self._c0 = time.process_time() * 1000.0
        m = fit(pick, slots.room, self.widths)  # near an image's end: the widest of its widths that fits
        if m == 0:
            return None
        d, k = self.shapes(slots)
        d = np.minimum(d, m)  # a tree of m nodes is at most m deep
        if d.max(initial=0) <= 0:
            return None
        budget = np.array([min(m, shape_budget(int(a), int(b), self.cfg)) if a > 0 else 0 for a, b in zip(d, k)])
        return RoundPlan(int(d.max()), int(k[d > 0].max()), m, d, k, budget)

    def _cost_ms(self, round_ms: float) -> float:
        return (time.process_time() * 1000.0 - self._c0) if self.cpu else round_ms

    def observe(self, plan: RoundPlan, outcome: RoundOutcome, slots: int, round_ms: float, draft_ms: float) -> None:
        m = plan.nodes
        per_slot = float(outcome.accepted.sum()) / max(slots, 1)  # extra tokens per slot
        self.run += 1
        self.drafted += 1
        self.same = self.same + 1 if m == self.last else 1
        self.last = m
        if self.run > 1:  # a run's first round pays the switch (and, at start, one-off costs)
            base = self._base()
            amid = bool(self.trying) and self.before == 0  # a probe amid plain steps: a run's rounds teach the spread
            ms = self.rows.drafted(self._cost_ms(round_ms), learn=not amid)  # on the rows drafting leaves
            extra = ms - self._forward()[self.widths.index(m)]  # m: one of the widths (`_pick`)
            self.over = extra if self.over is None else self.over + SLOW * (extra - self.over)
            if self.run > WARM:  # (the stop is for a run that goes on: its window is warm)
                self.reals += 1  # (a wave's easy first rounds must not carry a run of losing ones)
                self.real, self.real2 = _fold(self.real, self.real2, (1 + per_slot) * base / max(ms, 1e-6), self.reals)
        if self.same > WARM:  # a window this width's own rounds filled
            n = self.seen[m] = self.seen.get(m, 0) + 1
            self.gain[m], self.gain2[m] = _fold(self.gain.get(m), self.gain2.get(m), per_slot, n)
            self._gains_changed()
        self._probed()

    def _probed(self) -> None:
        """After a probe's last round: probe less often while the choice stays as it was."""
        if self.left == 0 and self.trying:
            same = self.choice() == self.before
            ratio = self.real  # drafted over plain rate
            clear = ratio is not None and ratio < CLEAR  # drafting far behind
            cap = max(PROBE_MAX, int(SHORT * (1.0 / max(ratio, 1e-3) - 1.0) / PROBE_SHARE)) if clear else PROBE_MAX
            self.probe = min((8 if clear else 2) * self.probe, cap) if same else PROBE
            self.behind = clear and same
            self.trying = 0

    def holds(self, slots: int) -> bool:
        """Plain steps are the model's choice: refilled one by one instead, the rows spread over
        the image and every later step read ~35 keys per row more (emoji16, B 16, the defaults)."""
        return self.choice() == 0

    def observe_plain(self, slots: int, round_ms: float) -> None:
        self.run, self.drafted, self.last, self.same = 0, 0, 0, 0
        self.plains += 1
        if not self.judged:
            return  # the model's plain step far from a probe: `base` is read from those just before one
        if self.plains == 1 and self.base is None:
            return  # a decoder's first plain step pays one-off costs
        ms = self.rows.plain(self._cost_ms(round_ms)) - self.costs.key_ms * self.rows.lock  # as at lockstep, less
        self.base = ms if self.base is None else self.base + EMA * (ms - self.base)  # what its keys cost


def _se(mean: float, sq: float | None, n: int) -> float:
    """The standard error of a running estimate (`_fold`) from its readings' mean and mean square."""
    if sq is None or n < 2:
        return 0.0
    return float(np.sqrt(max(sq - mean * mean, 0.0) / n))


def _fold(mean: float | None, sq: float | None, x: float, n: int) -> tuple[float, float]:
    """The n-th reading x folded into a running mean and mean square (`_se` reads both): the mean
    of the first 1 / SLOW readings, then an EMA of SLOW."""
    w = max(SLOW, 1.0 / n)
    mean, sq = x if mean is None else mean, x * x if sq is None else sq
    return mean + w * (x - mean), sq + w * (x * x - sq)
