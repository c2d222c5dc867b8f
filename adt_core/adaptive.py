"""ADT-Tree controller: adjacency-initialised, bisectionally adapted draft-tree shapes.

Definition (docs/adt_tree.md; every constant is a field of `AdaptiveConfig`):

1. Adjacency init. A map over the image grid records, for each committed token, the
   (d, k, alpha) of the round that committed it. A round whose first drafted token lands at
   (r, c) starts from the record at (r, c-1) (horizontal); at a row start, or when that cell has
   no record, from (r-1, c) (vertical); else from the defaults (d0, k0), unadapted.
   `init="vertical"` tries (r-1, c) first. `init="both"` starts like horizontal and averages the
   record's alpha with the mean alpha recorded along row r-1 over columns c .. c+d (long accepted
   runs above predict an easy region).
2. Bisectional adaptation of the start record with its alpha (a / d of that round):
   alpha >= beta: d <- d + ceil((d_max - d) / 2), k <- k - ceil((k - k_min) / 2)   (deeper, narrower)
   alpha <  beta: d <- d - ceil((d - d_min) / 2), k <- k + ceil((k_max - k) / 2)   (shallower, wider)
   `mode="step"` moves by fixed steps l_d, l_k instead, clamped to the bounds.
3. Budget. `budget="shape"`: n = clamp(round(gamma * d * k), n_min, n_max), never more than the
   k + (d-1) k^2 candidates the tree can hold. `budget="cost"`: the batch cost budget of
   adt_core/budget.py decides whether to draft, how many levels and how many nodes per image,
   from the measured `CostTable` of this device at this batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adt_core.config import AdaptiveConfig


@dataclass(frozen=True)
class Shape:
    depth: int  # d: draft levels
    width: int  # k: top-k per expansion and frontier size
    budget: int  # n: drafted nodes kept after reranking


@dataclass(frozen=True)
class Record:
    depth: int
    width: int
    alpha: float  # accepted / depth of the round that committed the token


def bisect_update(d: int, k: int, alpha: float, cfg: AdaptiveConfig) -> tuple[int, int]:
    """One adaptation step from a round's shape and acceptance (rule 2)."""
    deeper = alpha >= cfg.beta
    if cfg.mode == "step":
        if deeper:
            return min(d + cfg.l_d, cfg.d_max), max(k - cfg.l_k, cfg.k_min)
        return max(d - cfg.l_d, cfg.d_min), min(k + cfg.l_k, cfg.k_max)
    if deeper:
        return d + math.ceil((cfg.d_max - d) / 2), k - math.ceil((k - cfg.k_min) / 2)
    return d - math.ceil((d - cfg.d_min) / 2), k + math.ceil((cfg.k_max - k) / 2)


def shape_budget(d: int, k: int, cfg: AdaptiveConfig) -> int:
    """Rule 3 (shape mode): n = clamp(round(gamma d k), n_min, n_max) <= tree capacity."""
    n = min(max(round(cfg.gamma * d * k), cfg.n_min), cfg.n_max)
    return max(1, min(n, k + (d - 1) * k * k))


class AdaptiveController:
    """Per-image state of the ADT-Tree controller over an H x W grid."""

    def __init__(self, grid: tuple[int, int], cfg: AdaptiveConfig) -> None:
        if cfg.init not in ("horizontal", "vertical", "both"):
            raise ValueError(f"adaptive.init must be horizontal, vertical or both, got {cfg.init!r}")
        if cfg.mode not in ("bisect", "step"):
            raise ValueError(f"adaptive.mode must be bisect or step, got {cfg.mode!r}")
        self.h, self.w = grid
        self.cfg = cfg
        self.records: list[Record | None] = [None] * (self.h * self.w)

    def _at(self, r: int, c: int) -> Record | None:
        if 0 <= r < self.h and 0 <= c < self.w:
            return self.records[r * self.w + c]
        return None

    def start_record(self, index: int) -> Record | None:
        """The record a round starts from when its first drafted token is image token `index`."""
        r, c = divmod(index, self.w)
        left = self._at(r, c - 1) if c > 0 else None
        up = self._at(r - 1, c)
        first, second = (up, left) if self.cfg.init == "vertical" else (left, up)
        rec = first if first is not None else second
        if rec is None or self.cfg.init != "both" or r == 0:
            return rec
        above = [x.alpha for x in (self._at(r - 1, cc) for cc in range(c, c + rec.depth + 1)) if x is not None]
        if not above:
            return rec
        return Record(rec.depth, rec.width, 0.5 * (rec.alpha + sum(above) / len(above)))

    def shape(self, index: int) -> Shape:
        """Shape (d, k, n) for a round whose first drafted token is image token `index`."""
        cfg = self.cfg
        rec = self.start_record(index)
        if rec is None:
            d, k = cfg.d0, cfg.k0
        else:
            d, k = bisect_update(rec.depth, rec.width, rec.alpha, cfg)
        d = min(max(d, cfg.d_min), cfg.d_max)
        k = min(max(k, cfg.k_min), cfg.k_max)
        return Shape(d, k, shape_budget(d, k, cfg))

    def observe(self, first_index: int, depth: int, width: int, accepted: int) -> None:
        """Record a verified round: it committed tokens first_index .. first_index + accepted
        (accepted drafted tokens + the bonus token)."""
        if depth <= 0:
            return
        rec = Record(depth, width, accepted / depth)
        for i in range(first_index, min(first_index + accepted + 1, len(self.records))):
            self.records[i] = rec
