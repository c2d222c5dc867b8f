"""The cost-aware draft budget for a batch of images in flight (ADT-Tree "cost" mode).

With A slots in flight a plain AR step commits A tokens for cost(A) ms: one token is worth
cost(A) / A ms. A round that drafts pays the draft levels and a wider verify forward; the
forward is padded to the widest slot's tree, so keeping m nodes per slot costs
cost(A (1 + m)) whatever the slots' individual trees. The budget, per round:

1. whether to draft at all (`BatchBudget`): a drafted round must commit tokens EDGE times faster
   than a plain AR step with about as many slots, measured as the rate ratio of adjacent rounds
   (a step's cost drifts as images grow and the batch refills; only neighbours compare).
   Otherwise the round is a plain batched AR step (the drafter is not run, and it is not fed the
   pairs of plain steps it will not need; it catches up on the last few in one forward when
   drafting resumes). Slot counts share measurements by power of two. The first count measured
   alternates the two kinds a few times; a new count (a draining batch, another decoder of the
   same Generator) takes the nearest measured one's choice and is measured by its probes. The
   losing choice is tried again after `PROBE_EVERY` rounds, the interval doubling (four-fold
   when the loser is far behind; up to `PROBE_MAX`) while probes confirm the winner, so a change
   of regime (an easier part of the images, another batch size) is noticed at a small cost.
   This uses the clock because the drafter's real cost per level (bookkeeping, scoring, tree
   building) is what decides; shapes and outputs stay exact either way.
2. levels and nodes (`RoundPlanner`, adt_core/planner.py), decided on the host before the round
   from what the previous drafted rounds showed (their candidates' path confidences, calibrated
   by the tokens they actually committed) and the measured `CostTable`: nodes m maximise
   (A + expected accepted tokens) / (cost(A (1 + m)) + draft time) over a few width buckets;
   a level is kept while its expected tokens are worth its measured cost at the AR token price.

Outputs never depend on any of these decisions (coupled / greedy exactness).
"""

from __future__ import annotations

from adt_core.calibrate import CostTable
from adt_core.config import AdaptiveConfig

PROBE_EVERY, PROBE_MAX = 32, 512
CLEAR_LOSS = 0.6  # a probe this far behind the winner (rate ratio) backs off four-fold
EMA = 0.2  # the planner's smoothing of its own estimates (acceptance calibration, level cost)
PAIR_EMA = 0.3  # weight of a new pair in a bucket's gain once `samples` pairs are in
NEAR = 2  # rounds apart at most for a drafted and a plain round to form a pair
SAMPLES = 3  # pairs measured (a plain mean) before a bucket's gain decides
EDGE = 1.03  # drafting must measure this much faster than plain steps to be chosen: the rates are
# noisy on a shared machine, and a plain step is the safe choice (it costs exactly what `ar` pays)


class BatchBudget:
    """Whether the next round drafts, from measured pairs of adjacent rounds.

    A step's cost drifts as images grow (attention reads every cached key) and as the batch
    refills, so rates measured at different times do not compare. The budget only ever compares
    a drafted round with a plain round of the same slot bucket at most NEAR rounds away: their
    rate ratio (drafted / plain) is a pair, and a bucket's gain is the mean of its first pairs,
    then a moving average. The first bucket alternates the two kinds until it has `samples`
    pairs; afterwards the losing kind runs only as a probe, which pairs with the winner's rounds
    on either side of it."""

    def __init__(self, costs: CostTable, cfg: AdaptiveConfig, samples: int = SAMPLES) -> None:
        self.costs, self.cfg, self.samples = costs, cfg, samples
        self.gain: dict[int, float] = {}  # bucket -> drafted / plain rate, from pairs of adjacent rounds
        self.pairs: dict[int, int] = {}  # bucket -> pairs measured
        self.last: dict[tuple[int, bool], tuple[int, float]] = {}  # (bucket, drafted) -> (round, tokens per ms)
        self.round = 0  # rounds measured
        self.since_probe = 0
        self.probe_every = PROBE_EVERY  # doubles while probes confirm the winner, up to PROBE_MAX

    def token_ms(self, a: int) -> float:
        """Modelled milliseconds per committed token of a plain AR step with `a` slots."""
        return self.costs.cost(a) / a

    @staticmethod
    def bucket(a: int) -> int:
        """Slot counts share measurements by power of two (1, 2-3, 4-7, ...): a draining batch
        passes through few buckets, not one exploration per image that leaves."""
        return a.bit_length()

    def _winner(self, k: int) -> bool | None:
        """Whether drafting measured faster in bucket k (None: not enough pairs yet)."""
        if self.pairs.get(k, 0) < self.samples:
            return None
        return self.gain[k] > EDGE

    def _choice(self, k: int) -> bool | None:
        """Bucket k's choice: its own winner, else the nearest measured bucket's (None: nothing
        measured anywhere yet)."""
        better = self._winner(k)
        if better is not None:
            return better
        known = sorted((b for b in self.gain if self._winner(b) is not None), key=lambda b: abs(b - k))
        return bool(self._winner(known[0])) if known else None

    def worth_drafting(self, a: int) -> bool:
        k = self.bucket(a)
        choice = self._choice(k)
        if choice is None:
            d, p = self.last.get((k, True), (-1, 0.0)), self.last.get((k, False), (-1, 0.0))
            return d[0] <= p[0]  # the first bucket: alternate, drafting first
        if self.since_probe >= self.probe_every:
            return not choice  # probe the losing choice (a new bucket is measured only by probes)
        return choice

    def probing(self, a: int) -> bool:
        """True when the next round of `a` slots measures rather than exploits (exploring the
        first bucket, or a probe of the losing choice): the planner's model may not veto it."""
        return self._choice(self.bucket(a)) is None or self.since_probe >= self.probe_every

    def plain_ahead(self, a: int, rounds: int) -> bool:
        """True when the next `rounds` rounds of `a` slots will be plain steps (the drafter then
        needs none of their pairs)."""
        return self._choice(self.bucket(a)) is False and self.since_probe + rounds < self.probe_every

    def observe_round(self, a: int, drafted: bool, ms: float, tokens: int) -> None:
        """A finished round with `a` slots: whether it drafted, its ms, tokens committed."""
        k = self.bucket(a)
        rate = tokens / max(ms, 1e-6)
        self.round += 1
        before = self._choice(k)
        other = self.last.get((k, not drafted))
        if other is not None and self.round - other[0] <= NEAR:
            ratio = rate / other[1] if drafted else other[1] / rate  # drafted / plain
            n = self.pairs[k] = self.pairs.get(k, 0) + 1
            step = 1.0 / n if n <= self.samples else PAIR_EMA
            self.gain[k] = ratio if n == 1 else self.gain[k] + step * (ratio - self.gain[k])
        self.last[(k, drafted)] = (self.round, rate)
        if before is None:
            return
        if drafted != before:  # a probe of the losing choice
            self.since_probe = 0
            same = self._choice(k) == before
            grow = 2
            if k in self.gain:
                g = self.gain[k]
                grow = 4 if min(g, 1 / max(g, 1e-9)) < CLEAR_LOSS else 2
            self.probe_every = min(grow * self.probe_every, PROBE_MAX) if same else PROBE_EVERY
        else:
            self.since_probe += 1
