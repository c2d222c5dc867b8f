"""Round planners: what each method drafts, decided once per round on the host.

A planner is picked once per Generator (adt_core/round/planners.py: `planner_for`) and answers `plan(slots)` with a
`RoundPlan` (levels D, width K, kept nodes M, and per-slot depth / width / node budget) or None
(a plain AR step). It reads only host state: the slots' committed counts and what earlier rounds
reported (`RoundOutcome`, read back once per round), so planning never waits for the device.

- `ar`: never drafts.
- `eagle2`: D = tree.depth, K = tree.top_k, M = tree.budget for every slot (a tree fixed by hand;
  unset, EAGLE-2's tree is sized for the device: adt_core/round/cost_plan.py `SizedEaglePlanner`).
- `static`: the fixed tree (cut to the image's end).
- `adt` (budget "shape", the paper's): each slot's (d, k) from the ADT-Tree controller
  (adt_core/round/adaptive.py), n = gamma d k kept nodes; the batch's D, K, M are the slots' largest.
- `jacobi`: as `adt` (either budget); its drafts come from the target's own window
  (adt_core/round/jacobi.py), so a draft level costs no model forward (the cost table's draft part
  is 0); its cost budget is adt_core/round/jacobi_plan.py (`JacobiPlanner`).
- `adt` (budget "cost", the default): the slots' (d, k) as above, levels and nodes sized and
  drafting decided by the measured costs: adt_core/round/cost_plan.py (`CostPlanner`).

Verify widths are padded to a few buckets (WIDTHS), so a compiled or captured step can serve them.
Each planner class owns its cache extent (`extent(config)`: the widest tree it verifies, what a
round feeds the drafter), read by the decoder and by adt_core/memory.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from adt_core.calibrate import CostTable
from adt_core.config import AdaptiveConfig, DecodeConfig
from adt_core.round.adaptive import AdaptiveGrid, shape_budget
from adt_core.round.state import Extent, RoundOutcome, RoundPlan, Slots

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # drafted nodes per slot a verify may carry
ROOM = 16  # tree nodes the cost planners' cache rows hold past an image's end (`Extent.room`): attention
# strides over every row's whole allocation, and a 64-node room made a plain step of 64 emoji16@32 images
# ~3% dearer than `ar`'s (rows of 354 entries against 290); early in an image a row has room for any tree,
# and near its end the tree is cut to what is left (`fit`), where depth is cut to the tokens left anyway
RESUME = 4  # pairs a plain run keeps for the drafter ahead of a possible draft: its catch-up when drafting
# resumes is one forward over at most these (a 16-pair catch-up at 64 in flight cost ~1.5 plain steps here)


def bucket(m: int) -> int:
    """The smallest width bucket holding m nodes (m itself past the largest)."""
    return next((w for w in WIDTHS if w >= m), m)


def fit(m: int, room: int, widths: tuple[int, ...] = WIDTHS) -> int:
    """The widest of `widths` of at most m nodes that fits `room` (`Slots.room`; 0: none does)."""
    return m if m <= room else max((w for w in widths if w <= room), default=0)


def roomy(e: Extent) -> Extent:
    """A cost planner's extent: its widest tree, held in rows with ROOM nodes past an image's end."""
    return replace(e, room=min(e.nodes, ROOM))


def fed(config: DecodeConfig, levels: int, width: int) -> int:
    """Drafter-cache entries one round may feed: `levels` expansions of `width` (a static tree's
    nodes, when larger); 0 for a method without a drafter."""
    return max(len(config.tree.static_paths or ()), levels * width) if config.needs_drafter else 0


class Planner:
    """Never drafts (method "ar")."""

    drafts = False
    reads_rows = False  # whether `ragged` is told each round's keys (the cost budgets: `RowsJudged`)
    reads_curves = False  # whether a round reads back its acceptance curves (RoundOutcome.level_conf, .curve)

    def adopt(self, earlier: "Planner") -> None:
        """Start from what an earlier decoder of the same Generator learned (nothing here)."""

    def share(self, other: "Planner") -> None:
        """Use the draft-or-not measurements of another capacity's planner of the same Generator
        (they are per slot count, not per capacity; nothing here)."""

    def narrow(self, capacity: int) -> None:
        """The decoder's images go on in `capacity` slots (BatchDecoder.narrow): what the planner
        learned per image stays; its model of a round's cost is now of that many slots."""

    def __init__(self, n_tokens: int) -> None:
        self.n = n_tokens

    @classmethod
    def build(cls, config: DecodeConfig, n_tokens: int, grid: AdaptiveGrid | None, costs: CostTable | None,
              capacity: int) -> "Planner":
        """This planner for a Generator's config (its grid and cost table where it reads them)."""
        return cls(n_tokens)

    @classmethod
    def extent(cls, config: DecodeConfig) -> Extent:
        """The cache entries this method's rounds need past the committed sequence."""
        return Extent(0, 0)

    def room(self, slots: Slots) -> np.ndarray:
        """(C,) levels each slot can still draft (0 for free slots and an image's last token)."""
        return np.where(slots.active, np.maximum(self.n - slots.host_count - 1, 0), 0)

    def plan(self, slots: Slots) -> RoundPlan | None:
        return None

    def observe(self, plan: RoundPlan, outcome: RoundOutcome, slots: int, round_ms: float, draft_ms: float) -> None:
        """A speculative round finished (times in ms, `slots` active)."""

    def observe_plain(self, slots: int, round_ms: float) -> None:
        """A plain step finished."""

    def plain_ahead(self, slots: int, rounds: int) -> bool:
        """True when the next `rounds` rounds with `slots` active will be plain steps (never for
        `ar`, whose slots finish together, nor for the methods that always draft)."""
        return False

    def holds(self, slots: int) -> bool:
        """True when plain steps are this planner's choice with `slots` active, its probes aside:
        a wave's free slots may then wait for the rest of it (`SlotTable.admits_now`), and the
        rounds while they wait are plain steps (`Slots.held`; a probe waits for the refill)."""
        return False

    def feeds_drafter(self, slots: int) -> bool:
        """Whether a plain step with `slots` active must keep its pairs for the drafter (False
        when the next RESUME rounds will not draft: their pairs are skipped for good)."""
        return self.drafts and not self.plain_ahead(slots, RESUME)

    @staticmethod
    def _fixed(depth: np.ndarray, width: int, nodes: int) -> RoundPlan | None:
        if depth.max(initial=0) <= 0:
            return None
        full = lambda v: np.full(depth.shape, v, np.int64)  # noqa: E731
        return RoundPlan(int(depth.max()), width, nodes, depth, full(width), full(nodes))


class EaglePlanner(Planner):
    drafts = True

    def __init__(self, n_tokens: int, config: DecodeConfig) -> None:
        super().__init__(n_tokens)
        self.tree = config.tree

    @classmethod
    def build(cls, config, n_tokens, grid, costs, capacity) -> "Planner":
        return cls(n_tokens, config)

    @classmethod
    def extent(cls, config: DecodeConfig) -> Extent:
        return Extent(config.tree.budget, fed(config, config.tree.depth, config.tree.top_k))

    def plan(self, slots: Slots) -> RoundPlan | None:
        return self._fixed(np.minimum(self.room(slots), self.tree.depth), self.tree.top_k, self.tree.budget)


class StaticPlanner(EaglePlanner):
    @classmethod
    def extent(cls, config: DecodeConfig) -> Extent:
        return Extent(len(config.tree.static_paths), fed(config, config.tree.depth, config.tree.top_k))

    def plan(self, slots: Slots) -> RoundPlan | None:
        depth = np.minimum(self.room(slots), self.tree.depth)
        nodes = sum(1 for p in self.tree.static_paths if len(p) <= depth.max(initial=0))
        return self._fixed(depth, 0, nodes)


class ShapePlanner(Planner):
    """ADT-Tree with the paper's fixed node budget n = clamp(round(gamma d k), n_min, n_max)."""

    drafts = True

    def __init__(self, n_tokens: int, cfg: AdaptiveConfig, grid: AdaptiveGrid) -> None:
        super().__init__(n_tokens)
        self.cfg, self.grid = cfg, grid

    @classmethod
    def build(cls, config, n_tokens, grid, costs, capacity) -> "Planner":
        return cls(n_tokens, config.adaptive, grid)

    @classmethod
    def extent(cls, config: DecodeConfig) -> Extent:
        a = config.adaptive
        return Extent(bucket(a.n_max), fed(config, a.d_max, a.k_max))

    def shapes(self, slots: Slots) -> tuple[np.ndarray, np.ndarray]:
        d, k = self.grid.shapes(slots.host_count)
        return np.minimum(d, self.room(slots)), k

    def plan(self, slots: Slots) -> RoundPlan | None:
        d, k = self.shapes(slots)
        if d.max(initial=0) <= 0:
            return None
        budget = np.array([shape_budget(int(a), int(b), self.cfg) if a > 0 else 0 for a, b in zip(d, k)])
        live = d > 0
        return RoundPlan(int(d.max()), int(k[live].max()), bucket(int(budget.max())), d, k, budget)
