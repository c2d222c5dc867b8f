"""The cost-aware draft budget for a batch of images in flight (ADT-Tree "cost" mode).

With A slots in flight a plain AR step commits A tokens for cost(A) ms: one token is worth
cost(A) / A ms. A round that drafts pays the draft levels and a wider verify forward; the
forward is padded to the widest slot's tree, so keeping m nodes per slot costs
cost(A (1 + m)) whatever the slots' individual trees. The budget, per round:

1. whether to draft at all: the measured rate (committed tokens per ms) of the recent drafted
   rounds must beat that of the recent plain AR steps with about as many slots by EDGE;
   otherwise the round is a plain batched AR step (the drafter is not run, and it is not fed
   the pairs of plain steps it will not need; it catches up on the recent pairs in one forward
   when drafting resumes). Slot counts share measurements by power of two. The first count
   measured tries each kind a few times; a new count takes the nearest measured one's choice
   and is measured by its probes, so a draining batch does not explore at every size it passes
   through. The losing choice is tried again after `PROBE_EVERY` rounds, the interval doubling
   (four-fold when the loser is far behind; up to `PROBE_MAX`) while probes confirm the winner,
   so a change of regime (an easier part of the images, another batch size) is noticed at a
   small cost. This uses the clock because the drafter's real cost per level (bookkeeping,
   scoring, tree building) is what decides; shapes and outputs stay exact either way.
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
EMA = 0.2
SAMPLES = 3  # rounds of each kind measured (a plain mean) before the two are compared
EDGE = 1.03  # drafting must measure this much faster than plain steps to be chosen: the rates are
# noisy on a shared machine, and a plain step is the safe choice (it costs exactly what `ar` pays)


class BatchBudget:
    def __init__(self, costs: CostTable, cfg: AdaptiveConfig, samples: int = SAMPLES) -> None:
        self.costs, self.cfg, self.samples = costs, cfg, samples
        self.rate: dict[tuple[int, bool], float] = {}  # (slots, drafted) -> running mean tokens per ms
        self.count: dict[tuple[int, bool], int] = {}  # rounds measured per key
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

    def _known(self, key: tuple[int, bool]) -> bool:
        return self.count.get(key, 0) >= self.samples

    def _winner(self, k: int) -> bool | None:
        """Whether drafting measured faster in bucket k (None: not both measured enough yet)."""
        if not (self._known((k, True)) and self._known((k, False))):
            return None
        return self.rate[(k, True)] > EDGE * self.rate[(k, False)]

    def _choice(self, k: int) -> bool | None:
        """Bucket k's choice: its own winner, else the nearest measured bucket's (None: nothing
        measured anywhere yet)."""
        better = self._winner(k)
        if better is not None:
            return better
        known = sorted({b for b, _ in self.rate if self._winner(b) is not None}, key=lambda b: abs(b - k))
        return bool(self._winner(known[0])) if known else None

    def worth_drafting(self, a: int) -> bool:
        k = self.bucket(a)
        choice = self._choice(k)
        if choice is None:
            return not self._known((k, True))  # the first bucket: measure drafting first, then plain steps
        if self.since_probe >= self.probe_every:
            return not choice  # probe the losing choice (a new bucket is measured only by probes)
        return choice

    def probing(self, a: int) -> bool:
        """True when the next round of `a` slots is due to probe the losing choice."""
        return self._choice(self.bucket(a)) is not None and self.since_probe >= self.probe_every

    def plain_ahead(self, a: int, rounds: int) -> bool:
        """True when the next `rounds` rounds of `a` slots will be plain steps (the drafter then
        needs none of their pairs)."""
        return self._choice(self.bucket(a)) is False and self.since_probe + rounds < self.probe_every

    def observe_round(self, a: int, drafted: bool, ms: float, tokens: int) -> None:
        """A finished round with `a` slots: whether it drafted, its wall ms, tokens committed."""
        k = self.bucket(a)
        key, r = (k, drafted), tokens / max(ms, 1e-6)
        before = self._choice(k)
        n = self.count[key] = self.count.get(key, 0) + 1
        step = 1.0 / n if n <= self.samples else EMA  # a plain mean of the first samples, then a moving one
        self.rate[key] = r if n == 1 else self.rate[key] + step * (r - self.rate[key])
        if before is None:
            return
        if drafted != before:  # a probe of the losing choice
            self.since_probe = 0
            same = self._choice(k) == before
            grow = 2
            if self._winner(k) is not None:
                lo, hi = sorted((self.rate[(k, True)], self.rate[(k, False)]))
                grow = 4 if lo < CLEAR_LOSS * hi else 2
            self.probe_every = min(grow * self.probe_every, PROBE_MAX) if same else PROBE_EVERY
        else:
            self.since_probe += 1
