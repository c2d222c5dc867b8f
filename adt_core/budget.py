"""The cost-aware draft budget for a batch of images in flight (ADT-Tree "cost" mode).

With A slots in flight a plain AR step commits A tokens for cost(A) ms: one token is worth
cost(A) / A ms. A round that drafts pays the draft levels and a wider verify forward; the
forward is padded to the widest slot's tree, so keeping m nodes per slot costs
cost(A (1 + m)) whatever the slots' individual trees. The budget, per round:

1. whether to draft at all: the measured rate (committed tokens per ms of wall time) of the
   recent drafted rounds must beat that of the recent plain AR steps with about as many slots
   (counts share measurements by power of two, and a new count starts from the nearest measured
   one's choice); otherwise the round is a plain batched AR step (the drafter is not run; it catches
   up on the skipped pairs in one forward when drafting resumes). Each choice is tried first,
   and the losing one is tried again after `PROBE_EVERY` rounds, the interval doubling (four-fold
   when the loser is far behind; up to `PROBE_MAX`) while probes confirm the winner, so a change of regime (a draining batch, an
   easier part of the images) is noticed at a small cost. This uses the clock because the
   drafter's real cost per level (bookkeeping, scoring, tree building) is what decides; shapes
   and outputs stay exact either way.
2. levels: a level is built while its expected extra tokens (the summed path confidences of
   the nodes it expands, over all slots) are worth more than its cost at the AR token price.
3. nodes: m maximises (A + sum over slots of their m best path confidences) /
   (cost(A (1 + m)) + draft time): with a padded forward, adding nodes in order of confidence
   from any slot raises the common width one step at a time, so this IS the greedy rule
   "add while the marginal tokens per marginal second beat the current rate". m = 0 is an AR step.

Levels and nodes come from a measured `CostTable` (calibrate.py); outputs never depend on any
of these decisions (coupled / greedy exactness).
"""

from __future__ import annotations

import torch

from adt_core.calibrate import CostTable
from adt_core.config import AdaptiveConfig

PROBE_EVERY, PROBE_MAX = 32, 512
CLEAR_LOSS = 0.6  # a probe this far behind the winner (rate ratio) backs off four-fold
EMA = 0.2


class BatchBudget:
    def __init__(self, costs: CostTable, cfg: AdaptiveConfig) -> None:
        self.costs, self.cfg = costs, cfg
        self.rate: dict[tuple[int, bool], float] = {}  # (slots, drafted) -> running mean tokens per ms
        self.since_probe = 0
        self.probe_every = PROBE_EVERY  # doubles while probes confirm the winner, up to PROBE_MAX
        self._verify: dict[int, torch.Tensor] = {}

    def token_ms(self, a: int) -> float:
        """Modelled milliseconds per committed token of a plain AR step with `a` slots."""
        return self.costs.cost(a) / a

    @staticmethod
    def bucket(a: int) -> int:
        """Slot counts share measurements by power of two (1, 2-3, 4-7, ...): a draining batch
        passes through few buckets, not one exploration per image that leaves."""
        return a.bit_length()

    def _winner(self, k: int) -> bool | None:
        """Whether drafting measured faster in bucket k (None: not both measured yet)."""
        spec, ar = self.rate.get((k, True)), self.rate.get((k, False))
        return None if spec is None or ar is None else spec > ar

    def worth_drafting(self, a: int) -> bool:
        k = self.bucket(a)
        better = self._winner(k)
        if better is None:
            known = sorted({b for b, _ in self.rate if self._winner(b) is not None}, key=lambda b: abs(b - k))
            if (k, True) in self.rate or (k, False) in self.rate or not known:
                return (k, True) not in self.rate  # try drafting first, then a plain step
            return bool(self._winner(known[0]))  # a new bucket: the nearest measured one's choice
        if self.since_probe >= self.probe_every:
            return not better  # probe the losing choice
        return better

    def observe_round(self, a: int, drafted: bool, ms: float, tokens: int) -> None:
        """A finished round with `a` slots: whether it drafted, its wall ms, tokens committed."""
        k = self.bucket(a)
        key, r = (k, drafted), tokens / max(ms, 1e-6)
        before = self._winner(k)
        self.rate[key] = r if key not in self.rate else self.rate[key] + EMA * (r - self.rate[key])
        if before is None:
            return
        if drafted != before:  # a probe of the losing choice
            self.since_probe = 0
            same = self._winner(k) == before
            lo, hi = sorted((self.rate[(k, True)], self.rate[(k, False)]))
            grow = 4 if lo < CLEAR_LOSS * hi else 2
            self.probe_every = min(grow * self.probe_every, PROBE_MAX) if same else PROBE_EVERY
        else:
            self.since_probe += 1

    def level_gate(self, a: int):
        """gate(level, {slot: confidence of its frontier}, frontier tokens) -> build the level?"""
        price = self.token_ms(a)

        def gate(level: int, conf: dict[int, float], tokens: int) -> bool:
            return sum(conf.values()) * price >= self.costs.draft_cost(tokens)

        return gate

    def choose(self, scores: list[torch.Tensor], draft_ms: float) -> int:
        """scores: per slot (M_b,) candidate path scores (log confidences) -> nodes per slot m."""
        a = len(scores)
        hi = self.cfg.n_max
        cum = torch.zeros(hi + 1, dtype=torch.float64)
        for s in scores:
            conf = s.double().exp().sort(descending=True).values.cpu()[:hi]
            c = torch.cat([torch.zeros(1, dtype=torch.float64), conf.cumsum(0)])
            cum += torch.cat([c, c[-1:].expand(hi + 1 - c.numel())])
        rate = (a + cum) / (self._verify_ms(a) + draft_ms)  # (hi + 1,) tokens per ms for m = 0 .. hi
        return int(rate.argmax())

    def _verify_ms(self, a: int) -> torch.Tensor:
        """(n_max + 1,) modelled target forward ms with m = 0 .. n_max nodes per slot, `a` slots."""
        if a not in self._verify:
            ms = [self.costs.cost(a * (1 + m)) for m in range(self.cfg.n_max + 1)]
            self._verify[a] = torch.tensor(ms, dtype=torch.float64)
        return self._verify[a]

