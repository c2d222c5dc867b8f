"""The cost-aware draft budget for a batch of images in flight (ADT-Tree "cost" mode).

With A slots in flight a plain AR step commits A tokens for cost(A) ms: one token is worth
cost(A) / A ms. A round that drafts pays the draft levels and a wider verify forward; the
forward is padded to the widest slot's tree, so keeping m nodes per slot costs
cost(A (1 + m)) whatever the slots' individual trees. The budget, per round:

1. whether to draft at all (`BatchBudget`): a drafted round must commit tokens faster (EDGE = 1:
   the better rate, ties to plain steps) than the plain AR steps just before it with about as
   many slots (a step's cost drifts as images grow and the batch refills; only neighbours
   compare), in the latest comparisons: their mean tokens ratio over their median time ratio (one
   slow step on a shared machine must not start a run of losing drafts). Otherwise the round is a
   plain batched AR step (the drafter is not run, and it is not fed the pairs of plain steps it
   will not need; it catches up on the last few in one forward when drafting resumes). Slot
   counts share measurements by power of two. A count with no verdict of its own alternates the
   two kinds until it has one, unless the nearest measured count says plain steps: then (a
   draining batch, another decoder of the same Generator) it runs plain steps and is measured by
   its probes. A verdict for drafting is never borrowed: it must be measured at that count. The
   losing choice is tried again after `PROBE_EVERY` rounds, the interval doubling (four-fold when
   the loser is far behind; up to `PROBE_MAX`) while probes confirm the winner, so a change of
   regime (an easier part of the images, another batch size) is noticed at a small cost.
   This uses the clock because the drafter's real cost per level (bookkeeping, scoring, tree
   building) is what decides; shapes and outputs stay exact either way.
2. levels and nodes (`CostPlanner`, adt_core/round/cost_plan.py), decided on the host before the round
   from what the previous drafted rounds showed (their candidates' path confidences, calibrated
   by the tokens they actually committed) and the measured `CostTable`: nodes m maximise
   (A + expected accepted tokens) / (cost(A (1 + m)) + draft time) over a few width buckets;
   a level is kept while its expected tokens are worth its measured cost at the AR token price.

Outputs never depend on any of these decisions (coupled / greedy exactness).
"""

from __future__ import annotations

import numpy as np

from adt_core.calibrate import CostTable
from adt_core.config import AdaptiveConfig

PROBE_EVERY, PROBE_MAX = 32, 512
PROBE_RUN = 3  # rounds of a probe: its first is not compared (the first of a kind after the other costs more: at
# B 1 on emoji16 a plain step right after drafted rounds took 4.19 ms against 3.80 ms for the fifth); the median
# of the others is one comparison (a reading on a shared CPU swings +-20-30%; two halve a comparison's variance)
PROBE_NEAR = 4 * PROBE_RUN  # while the verdict is not yet sure (a near tie), the loser is probed after this many
# rounds: a fifth of the rounds (a near tie's gap of a few % costs <1%; half of them, with each switch paying
# ~8% of a round at B 1, lost 6-9%)
NEAR_MAX = 4 * PROBE_NEAR  # a near tie still unsure with a full WINDOW of comparisons: its probe interval doubles
# up to this while the call stays (more comparisons only replace older ones; at emoji16 B 4, T 0 a drafted round costs
# two plain steps, so probes every PROBE_NEAR rounds drafted a third of the time at a 5-7% loss)
CLEAR_LOSS = 0.85  # a probe this far behind the winner (rate ratio) backs off four-fold (a synthetic clock with
# +-30% readings and switches costing 10% of a round: 0.6 lost 2.7% and 3.1% of 1000 rounds where drafting ran
# at 0.7x and 0.85x of plain steps, 0.85 2.3% and 2.8%)
EMA = 0.2  # the planner's smoothing of its own estimates (acceptance calibration, level cost)
NEAR = 4  # a round is compared with the other kind's rounds among the NEAR rounds before it
SAMPLES = 3  # comparisons measured before a bucket has a verdict
WINDOW = 24  # a bucket's verdict: its latest WINDOW comparisons (`_gain`)
EDGE = 1.0  # drafting is chosen when its rate ratio (`_gain`) exceeds this (ties: plain steps, costing what `ar` pays)
SPREAD = 0.12  # the least spread assumed of one comparison's log ratio (a shared CPU: +-10-20% per reading)
RUN_SPREAD = 0.3  # the spread a run of drafted rounds is assumed to reach before it has run, as a share of `full`
# (rows spread evenly over an image): a finite job's waves keep it below `full` (the stand-in's B 16 at the defaults,
# 64 images, `eagle2` drafting every round: 0.37 on average, median 0.28; emoji16's B 16, 256 images: 0.53)
SURE_AFTER = 2  # comparisons before a verdict may be sure, in multiples of `samples`
SURE = 2.0  # a verdict is sure when its log rate ratio is this many standard errors from a tie
class Ragged:
    """Rounds judged against a lockstep batch: a drafted round on the rows drafting leaves, a plain
    step on the rows a wave refilled together would have.

    Attention reads every cache row up to the longest row. `ar`'s rows grow in lockstep; drafted
    rounds accept different numbers of tokens per slot, the slots then free and refill at
    different times, and the rows spread over the image: every later forward, plain or drafted,
    reads up to rows x n / 2 keys more (+20% for a plain step of 16 emoji16 images on a CPU).
    Comparing adjacent rounds cannot see that: a drafted round measured while the batch is still
    in lockstep is spared the spread it starts, and once the rows have spread both kinds pay it.
    So, with `key_ms` the table's cost per key and row (`CostTable.key_ms`), before each round
    `now(keys, full)` (the keys its forward reads past a lockstep batch's; `full`: those of rows
    spread evenly over an image):
    - a drafted round counts `drafted(ms)` = ms + key_ms x (spread - keys), `spread` the keys met
      by the drafted rounds of runs, decayed over about an image's drafted rounds (2 / n per
      round) from RUN_SPREAD x `full` (what a run reached in a job of a few waves); rounds that
      explore or probe amid plain steps meet rows the plain steps kept together and teach nothing
      of it. (The prior was `full`, the spread continuous refill reaches after many waves: at the
      stand-in's B 64 ~100 ms of a 300-500 ms round, and at its B 16 at the defaults adt's probes
      read a 1-node tree that won 7-9% as a loser and drafted 1-3% of rounds);
    - a plain step counts `plain(ms)` = ms - key_ms x keys: what it costs once a wave refills
      together (`Planner.holds`), which only plain steps allow.
    So a batch drafts only where drafting pays on the rows it leaves against plain steps on the
    rows they keep. A device or batch whose rows cost nothing per key (key_ms 0; one slot: full
    0) is judged as measured."""

    def __init__(self, key_ms: float, n_tokens: int) -> None:
        self.key_ms, self.decay = key_ms, min(1.0, 2.0 / max(n_tokens, 1))
        self.keys = 0.0  # past a lockstep batch's, before this round
        self.lock = 0.0  # keys a lockstep batch's forward reads, before this round
        self.count = 0  # the cache rows it read them in
        self.spread: float | None = None  # keys drafted rounds leave (None: nothing drafted yet)

    def now(self, keys: float, full: float, lock: float = 0.0, count: int = 0) -> None:
        self.keys, self.lock, self.count = keys, lock, count
        if self.spread is None:
            self.spread = RUN_SPREAD * full

    def plain(self, ms: float) -> float:
        """A plain step's ms as at lockstep: less the keys its forward read past a lockstep batch's
        (at most half of it). Plain steps on spread rows pay for the spread drafted rounds left;
        judged as measured they tie with drafting wherever the rows have spread, and drafting runs
        on (at emoji16 B 16, T 0 the comparisons' median stayed at 1.00-1.04 while both kinds ran
        4-5% dearer per token than `ar`'s steps). Plain steps are what lets a wave refill together
        (`Planner.holds`), so their lockstep cost is what they are worth."""
        return max(ms - self.key_ms * self.keys, 0.5 * ms)

    def drafted(self, ms: float, learn: bool = True) -> float:
        """learn=False: a round that measures drafting (exploring, a probe) amid plain steps meets
        rows that plain steps kept together, not the spread a run of drafted rounds leaves (at
        emoji16 B 16, T 0: 10-20 keys per row amid probes, 60 in a run)."""
        spread = self.keys if self.spread is None else self.spread
        if learn:
            self.spread = spread + self.decay * (self.keys - spread)
        return ms + self.key_ms * max(spread - self.keys, 0.0)


class BatchBudget:
    """Whether the next round drafts, from rounds compared with their neighbours.

    A step's cost drifts as images grow (attention reads every cached key) and as the batch
    refills, so rates measured at different times do not compare. A round of the rarer kind
    (a drafted round while plain steps win or while exploring, a plain probe while drafting
    wins) is compared with the other kind's rounds of the same slot bucket among the NEAR rounds
    before it: one comparison is their ratio of mean tokens and their ratio of median ms (drafted /
    plain). A bucket's gain over its latest WINDOW comparisons (`_gain`) is their mean tokens ratio
    over their median time ratio: a round slowed by other work on the machine decides little,
    while every token counts (the tokens a drafted round commits vary; their median is no mean).
    A bucket without a verdict alternates the kinds, plain first, until it has `samples`
    comparisons; afterwards the losing kind runs only as a probe. Near break-even a wrong call
    costs little and a sure one needs many comparisons: while the log gain is within SURE
    standard errors of a tie (`_sure`), the loser is probed every PROBE_NEAR rounds (a sequential
    test: the comparisons accumulate until the call is sure), and, once WINDOW of them are in and
    the call still is not sure, every NEAR_MAX rounds at most (the interval doubling while probes
    leave the call as it was); once sure, the probe interval grows to PROBE_MAX. A probe is
    PROBE_RUN rounds: the first pays the switch, the others are its one comparison."""

    def __init__(self, costs: CostTable, cfg: AdaptiveConfig, samples: int = SAMPLES) -> None:
        self.costs, self.cfg, self.samples = costs, cfg, samples
        self.ratios: dict[int, list[tuple[float, float]]] = {}  # bucket -> its latest comparisons (drafted / plain:
        # mean tokens, median ms)
        self.verdict: dict[int, bool] = {}  # bucket -> drafting measured faster (once it has `samples` comparisons)
        self.sure: dict[int, bool] = {}  # bucket -> its verdict is SURE standard errors from a tie
        # (bucket, drafted) -> its latest rounds: (round, tokens, ms)
        self.recent: dict[tuple[int, bool], list[tuple[int, int, float]]] = {}
        self.round = 0  # rounds measured
        self.since_probe = 0
        self.probe_every = PROBE_EVERY  # doubles while probes confirm the winner, up to PROBE_MAX
        self.near_every = PROBE_NEAR  # the probe interval while the call is not sure (`NEAR_MAX`)
        self.probe_run = 0  # rounds of the probe under way so far
        self.probe_rounds: list[tuple[int, int, float]] = []  # its rounds after the first: (round, tokens, ms)

    def token_ms(self, a: int) -> float:
        """Modelled milliseconds per committed token of a plain AR step with `a` slots."""
        return self.costs.cost(a) / a

    @staticmethod
    def bucket(a: int) -> int:
        """Slot counts share measurements by power of two (1, 2-3, 4-7, ...): a draining batch
        passes through few buckets, not one exploration per image that leaves."""
        return a.bit_length()

    @property
    def gain(self) -> dict[int, float]:
        """Bucket -> drafted / plain rate over its latest comparisons (`_gain`)."""
        return {k: _gain(r) for k, r in self.ratios.items() if r}

    def pairs(self, k: int) -> int:
        """Comparisons measured in bucket k."""
        return len(self.ratios.get(k, ()))

    def _winner(self, k: int) -> bool | None:
        """Whether drafting measured faster in bucket k (None: not enough comparisons yet)."""
        return self.verdict.get(k)

    def _choice(self, k: int) -> bool | None:
        """Bucket k's choice: its own winner, else plain steps where the nearest measured bucket
        chose them (None: measure this bucket; drafting is never taken on another's word)."""
        better = self._winner(k)
        if better is not None:
            return better
        if not self.verdict:
            return None
        nearest = min(self.verdict, key=lambda b: abs(b - k))
        return False if not self.verdict[nearest] else None

    def worth_drafting(self, a: int) -> bool:
        k = self.bucket(a)
        choice = self._choice(k)
        if choice is None:  # alternate, plain first
            last = lambda d: max((x[0] for x in self.recent.get((k, d), ())), default=-1)  # noqa: E731
            return last(False) > last(True)
        if self.since_probe >= self.probe_every:
            return not choice  # probe the losing choice (a bucket with a borrowed verdict: only by probes)
        return choice

    def probing(self, a: int) -> bool:
        """True when the next round of `a` slots measures rather than exploits (exploring a
        bucket, or a probe of the losing choice): the planner's model may not veto it."""
        return self._choice(self.bucket(a)) is None or self.since_probe >= self.probe_every

    def holds(self, a: int) -> bool:
        """True when plain steps are the choice for `a` slots (a probe of drafting may be due)."""
        return self._choice(self.bucket(a)) is False

    def judges(self, a: int) -> bool:
        """Whether the next round of `a` slots is measured: all but the plain steps taken while
        plain steps win with no probe of drafting due within NEAR rounds (a probe is compared with
        the NEAR rounds before it; earlier ones are never read). An unmeasured round only counts
        (`pass_round`): its planner skips the rows' read and the clock (at emoji16 B 4 on a CPU,
        ~70 us of a 4.7 ms plain step that `ar` does not pay)."""
        return self._choice(self.bucket(a)) is not False or self.since_probe + NEAR >= self.probe_every

    def pass_round(self) -> None:
        """A plain step `judges` left unmeasured: it counts towards the next probe."""
        self.round += 1
        self.since_probe += 1

    def plain_ahead(self, a: int, rounds: int) -> bool:
        """True when the next `rounds` rounds of `a` slots will be plain steps (the drafter then
        needs none of their pairs)."""
        return self.holds(a) and self.since_probe + rounds < self.probe_every

    def observe_round(self, a: int, drafted: bool, ms: float, tokens: int) -> None:
        """A finished round with `a` slots: whether it drafted, its ms, tokens committed."""
        k = self.bucket(a)
        self.round += 1
        row = (self.round, tokens, ms)
        before = self._choice(k)
        probe = before is not None and drafted != before
        span = NEAR
        mine = [row]
        if probe:  # a probe is PROBE_RUN rounds; its first pays the switch, the others are compared as one
            self.probe_run += 1
            self.probe_rounds = self.probe_rounds + [row] if self.probe_run > 1 else []
            if self.probe_run < PROBE_RUN:
                self._remember(k, drafted, row)
                return  # `since_probe` stays: the probe goes on
            mine = self.probe_rounds
            self.probe_run, self.probe_rounds, span = 0, [], NEAR + PROBE_RUN - 1
        if drafted != bool(before):  # the rarer kind: compare it with the other kind's rounds just before
            near = [x for x in self.recent.get((k, not drafted), ()) if self.round - x[0] <= span]
            if near:
                d, p = (mine, near) if drafted else (near, mine)
                ratios = self.ratios.setdefault(k, [])
                ratios.append((_tokens(d) / _tokens(p), _ms(d) / max(_ms(p), 1e-6)))
                del ratios[:-WINDOW]
                if len(ratios) >= self.samples:
                    self.verdict[k] = _gain(ratios) > EDGE
                    self.sure[k] = _sure(ratios, self.samples)
                    if not self.sure[k]:  # a near tie: the loser is measured again soon (`NEAR_MAX`)
                        near = self.near_every if len(ratios) >= WINDOW else PROBE_NEAR
                        self.probe_every = min(self.probe_every, near)
        self._remember(k, drafted, row)
        if before is None:
            return
        if probe:  # a probe of the losing choice
            self.since_probe = 0
            same = self._choice(k) == before
            grow = 2
            if k in self.ratios:
                g = _gain(self.ratios[k])
                grow = 4 if min(g, 1 / max(g, 1e-9)) < CLEAR_LOSS else 2
            if not self.sure.get(k, True):  # a near tie: keep measuring (a wrong call costs little here)
                full = len(self.ratios.get(k, ())) >= WINDOW
                self.near_every = min(2 * self.near_every, NEAR_MAX) if same and full else PROBE_NEAR
                self.probe_every = self.near_every
            else:
                self.probe_every = min(grow * max(self.probe_every, PROBE_EVERY // 2), PROBE_MAX) if same else PROBE_EVERY
        else:
            self.since_probe += 1


    def _remember(self, k: int, drafted: bool, row: tuple[int, int, float]) -> None:
        mine = self.recent.setdefault((k, drafted), [])
        mine.append(row)
        del mine[:-NEAR]


def _tokens(rows: list[tuple[int, int, float]]) -> float:
    """The mean tokens of some rounds (round, tokens, ms)."""
    return sum(x[1] for x in rows) / len(rows)


def _ms(rows: list[tuple[int, int, float]]) -> float:
    """The median ms of some rounds (of an even count, the mean of the middle two)."""
    return float(np.median([x[2] for x in rows]))


def _gain(ratios: list[tuple[float, float]]) -> float:
    """Drafted / plain rate over comparisons (tokens ratio, time ratio): the mean tokens ratio
    over the median time ratio (of an even count the upper middle one: ties go to plain steps).
    Tokens are what the images gave, so all count; time is what the machine gave, so a slow
    reading counts little. A median of rates is no rate where the tokens vary: at emoji16 B 1 at
    the defaults drafted rounds of ~5.6 ms committed 2 tokens or 1 (0.36 or 0.18 per ms); the
    median of rates read 0.36 where the rate was ~0.30, and drafting ran in half the rounds at
    0.93x of `ar`."""
    return float(np.mean([t for t, _ in ratios])) / max(_median([r for _, r in ratios], upper=True), 1e-9)


def _sure(ratios: list[tuple[float, float]], samples: int = SAMPLES) -> bool:
    """Whether the log gain (`_gain`) is SURE standard errors from a tie (log EDGE). The spread is
    the median absolute deviation of the comparisons' log rate ratios (one slow round must not
    make a clear loss look unsure), at least SPREAD (a few equal comparisons prove little on a
    noisy machine). Before SURE_AFTER x `samples` comparisons every comparison must also lie on
    the same side of the tie (three unlucky readings must not settle a near tie; three readings
    of 0.67-0.86 at emoji16 B 64 are no near tie, and probing them as one cost nine drafted
    rounds at a 30% loss)."""
    rates = np.asarray([t / max(r, 1e-9) for t, r in ratios], dtype=float)
    logs = np.log(np.maximum(rates, 1e-9)) - np.log(EDGE)
    if samples > 1 and len(ratios) < SURE_AFTER * samples and not (
            len(ratios) >= samples and ((logs > 0).all() or (logs < 0).all())):
        return False
    mid = float(np.log(max(_gain(ratios), 1e-9)) - np.log(EDGE))
    sd = max(1.4826 * float(np.median(np.abs(logs - np.median(logs)))), SPREAD)
    se = 1.2533 * sd / np.sqrt(len(logs))  # the standard error of a median
    return abs(mid) >= SURE * se


def _median(xs: list[float], upper: bool = False) -> float:
    """The middle value; of an even count, the lower (or upper) middle one: ties go to plain steps."""
    s = sorted(xs)
    return s[len(s) // 2] if upper else s[(len(s) - 1) // 2]
