"""EAGLE-2's tree sized for this device (method eagle2, `--decode.tree.*` unset): every slot, every
round, the same depth and EAGLE-2's top-k (EAGLE2_TREE), with levels D and kept nodes M chosen as
`CostPlanner` chooses them (adt_core/round/cost_plan.py, 2-3); it always drafts."""

from __future__ import annotations

import time

import numpy as np

from adt_core.config import EAGLE2_TREE, DecodeConfig
from adt_core.round.cost_plan import CostPlanner
from adt_core.round.plan import bucket, fed, roomy
from adt_core.round.state import Extent, RoundPlan, Slots


class SizedEaglePlanner(CostPlanner):
    """EAGLE-2 with its tree sized for this device (method eagle2, tree unset): every active
    slot drafts every round to the same depth D, expanding EAGLE-2's top-k per level and keeping
    the M best nodes, D and M chosen each round as `CostPlanner` chooses them (most expected
    tokens per ms at the measured costs, bookkeeping and acceptance). What it does not take from
    adt: ADT-Tree's per-slot shapes and the draft-or-plain guard (EAGLE-2 always drafts)."""

    TOP_K = EAGLE2_TREE["top_k"]

    @classmethod
    def extent(cls, config: DecodeConfig) -> Extent:
        a = config.adaptive
        return roomy(Extent(bucket(a.n_max), fed(config, a.d_max, cls.TOP_K)))

    def shapes(self, slots: Slots) -> tuple[np.ndarray, np.ndarray]:
        d = np.where(slots.active, self.cfg.d_max, 0)
        return np.minimum(d, self.room(slots)), np.full(d.shape, self.TOP_K)

    def plan(self, slots: Slots) -> RoundPlan | None:
        self._c0 = time.process_time() * 1000.0
        a = int(slots.active.sum())
        self._expects = None
        if a == 0:
            return None
        d, _ = self.shapes(slots)
        sized = self._fitted(a, self.TOP_K, slots.room)
        if sized is None:
            return None
        levels, m, _ = sized
        self._expects = self.expects(a, self.TOP_K, levels, m)
        return self._fixed(np.minimum(d, levels), min(self.TOP_K, max(m, self.cfg.k_min)), m)

    def plain_ahead(self, slots: int, rounds: int) -> bool:
        return False

    def holds(self, slots: int) -> bool:
        return False
