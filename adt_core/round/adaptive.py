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
   adt_core/round/budget.py decides whether to draft, how many levels and how many nodes per image,
   from the measured `CostTable` of this device at this batch size.
"""

from __future__ import annotations

import math

import numpy as np

from adt_core.config import AdaptiveConfig


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


class AdaptiveGrid:
    """The ADT-Tree controller for every slot at once: records over each slot's H x W grid as
    host arrays, rules 1-2 applied as whole-batch numpy (no per-slot Python in a round)."""

    def __init__(self, slots: int, grid: tuple[int, int], cfg: AdaptiveConfig) -> None:
        self.h, self.w = grid
        self.cfg = cfg
        n = self.h * self.w
        self.has = np.zeros((slots, n), bool)  # a record exists at (slot, raster index)
        self.depth = np.zeros((slots, n), np.int64)
        self.width = np.zeros((slots, n), np.int64)
        self.alpha = np.zeros((slots, n), np.float64)

    def narrow(self, order: np.ndarray) -> None:
        """Keep slots `order` (n,) as slots 0 .. n - 1 (BatchDecoder.narrow)."""
        self.has, self.depth, self.width, self.alpha = (x[order] for x in (self.has, self.depth, self.width, self.alpha))

    def reset(self, slots: np.ndarray) -> None:
        """Slots (bool (C,)) start a new image: no records."""
        self.has[slots] = False

    def _record(self, r: np.ndarray, c: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(has, flat index) of the records at (r, c) per slot where `ok`."""
        flat = np.clip(r, 0, self.h - 1) * self.w + np.clip(c, 0, self.w - 1)
        return ok & self.has[np.arange(len(r)), flat], flat

    def shapes(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(depth, width) (C,) each for rounds whose first drafted token is image token index (C,)."""
        cfg, slots = self.cfg, np.arange(len(index))
        r, c = np.divmod(np.minimum(index, self.h * self.w - 1), self.w)
        left = self._record(r, c - 1, c > 0)
        up = self._record(r - 1, c, r > 0)
        first, second = (up, left) if cfg.init == "vertical" else (left, up)
        has = first[0] | second[0]
        flat = np.where(first[0], first[1], second[1])
        d, k, a = self.depth[slots, flat], self.width[slots, flat], self.alpha[slots, flat]
        if cfg.init == "both":
            a = self._blend_above(r, c, d, a, has)
        deeper = a >= cfg.beta
        if cfg.mode == "step":
            d2 = np.where(deeper, np.minimum(d + cfg.l_d, cfg.d_max), np.maximum(d - cfg.l_d, cfg.d_min))
            k2 = np.where(deeper, np.maximum(k - cfg.l_k, cfg.k_min), np.minimum(k + cfg.l_k, cfg.k_max))
        else:
            up_half = lambda x: -(-x // 2)  # noqa: E731  ceil(x / 2) for integers
            d2 = np.where(deeper, d + up_half(cfg.d_max - d), d - up_half(d - cfg.d_min))
            k2 = np.where(deeper, k - up_half(k - cfg.k_min), k + up_half(cfg.k_max - k))
        d = np.clip(np.where(has, d2, cfg.d0), cfg.d_min, cfg.d_max)
        k = np.clip(np.where(has, k2, cfg.k0), cfg.k_min, cfg.k_max)
        return d, k

    def _blend_above(self, r, c, d, a, has) -> np.ndarray:
        """init "both": average alpha with the mean alpha recorded along row r - 1, columns c .. c + d."""
        slots = np.arange(len(r))
        row = (np.clip(r - 1, 0, None) * self.w)[:, None] + np.arange(self.w)  # (C, W)
        cols = np.arange(self.w)[None]
        span = (cols >= c[:, None]) & (cols <= (c + d)[:, None]) & self.has[slots[:, None], row]
        n = span.sum(1)
        mean = (self.alpha[slots[:, None], row] * span).sum(1) / np.maximum(n, 1)
        use = has & (r > 0) & (n > 0)
        return np.where(use, 0.5 * (a + mean), a)

    def observe(self, first: np.ndarray, depth: np.ndarray, width: np.ndarray, accepted: np.ndarray) -> None:
        """Verified rounds (C,) each: slot b committed tokens first .. first + accepted (accepted
        drafted + the bonus) with a tree of `depth` levels (0: no round for that slot)."""
        j = np.arange(int(accepted.max(initial=0)) + 1)[None]
        cells = first[:, None] + j  # (C, A + 1)
        on = (depth[:, None] > 0) & (j <= accepted[:, None]) & (cells < self.h * self.w)
        slot = np.broadcast_to(np.arange(len(first))[:, None], cells.shape)[on]
        cell = cells[on]
        self.has[slot, cell] = True
        self.depth[slot, cell] = np.broadcast_to(depth[:, None], cells.shape)[on]
        self.width[slot, cell] = np.broadcast_to(width[:, None], cells.shape)[on]
        alpha = accepted / np.maximum(depth, 1)
        self.alpha[slot, cell] = np.broadcast_to(alpha[:, None], cells.shape)[on]
