"""The cost-aware draft budget for a batch of images in flight (ADT-Tree "cost" mode).

With A slots in flight a plain AR step commits A tokens for cost(A) ms: one token is worth
cost(A) / A ms. A round that drafts pays the draft levels and a wider verify forward; the
forward is padded to the widest slot's tree, so keeping m nodes per slot costs
cost(A (1 + m)) whatever the slots' individual trees. The budget, per round:

1. whether to draft at all: the rate a drafted round is expected to reach (running means of
   accepted tokens and nodes per slot, modelled draft cost) must beat the AR rate A / cost(A);
   otherwise the round is a plain batched AR step (the drafter is not run; it catches up on
   the skipped pairs in one forward when drafting resumes). Every `PROBE_EVERY` skipped rounds
   one round drafts anyway, to refresh the means.
2. levels: a level is built while its expected extra tokens (the summed path confidences of
   the nodes it expands, over all slots) are worth more than its cost at the AR token price.
3. nodes: m maximises (A + sum over slots of their m best path confidences) /
   (cost(A (1 + m)) + draft time): with a padded forward, adding nodes in order of confidence
   from any slot raises the common width one step at a time, so this IS the greedy rule
   "add while the marginal tokens per marginal second beat the current rate". m = 0 is an AR step.

Costs come from a measured `CostTable` (calibrate.py), so the decisions depend on the table,
never on this run's timing; outputs never depend on them at all (coupled / greedy exactness).
"""

from __future__ import annotations

import torch

from adt_core.calibrate import CostTable
from adt_core.config import AdaptiveConfig

PROBE_EVERY = 16
EMA = 0.2


class BatchBudget:
    def __init__(self, costs: CostTable, cfg: AdaptiveConfig) -> None:
        self.costs, self.cfg = costs, cfg
        self.accepted: float | None = None  # running mean accepted drafted tokens per slot-round
        self.nodes: float | None = None  # running mean nodes per slot in drafted rounds
        self.draft_ms: float | None = None  # running mean modelled draft ms per drafted round, per slot
        self.skipped = 0

    def token_ms(self, a: int) -> float:
        """Milliseconds per committed token of a plain AR step with `a` slots."""
        return self.costs.cost(a) / a

    def worth_drafting(self, a: int) -> bool:
        if self.accepted is None or self.skipped >= PROBE_EVERY:
            return True
        m = max(self.nodes or 0.0, 1.0)
        spec = a * (1 + self.accepted) / (self.costs.cost(a * (1 + m)) + a * (self.draft_ms or 0.0))
        return spec > 1.0 / self.token_ms(a)

    def skip(self) -> None:
        self.skipped += 1

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
        best_m, best = 0, -1.0
        for m in range(hi + 1):
            rate = float(a + cum[m]) / (self.costs.cost(a * (1 + m)) + draft_ms)
            if rate > best:
                best_m, best = m, rate
        return best_m

    def observe(self, a: int, accepted: int, nodes: int, draft_ms: float) -> None:
        """A drafted round with `a` slots: accepted tokens and nodes in total, modelled draft ms."""
        self.skipped = 0
        acc, nod, dms = accepted / a, nodes / a, draft_ms / a
        if self.accepted is None:
            self.accepted, self.nodes, self.draft_ms = acc, nod, dms
        else:
            self.accepted += EMA * (acc - self.accepted)
            self.nodes += EMA * (nod - self.nodes)
            self.draft_ms += EMA * (dms - self.draft_ms)
