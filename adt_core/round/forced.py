"""Forced end-of-line tokens in the round (Lumina-mGPT's layout: an end-of-line after every
image row, so the row stride is W + 1).

The round generates image indices 0 .. N - 1 only; a forced token is never drafted, sampled or
counted. When a slot's ROOT (its last committed code, not yet in the cache) ends an image row,
the forward that caches the root also carries the end-of-line right after it (its "companion"
entry, at the next position); the companion's output is what predicts the next code, and the
cache keeps root + companion. Slots whose root does not end a row carry a padding companion
that nothing sees and the cache drops. Drafted nodes never cross a row end (`within_row`): a
node's children then always follow it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from adt_core.round.state import RoundPlan, Slots


@dataclass(frozen=True)
class ForcedEol:
    """A layout's end-of-line token: its id, the grid width W and the image's N codes."""

    eol_id: torch.Tensor  # () long: the end-of-line token id
    width: int  # W, image codes per row
    n_tokens: int  # N
    rows: Callable[[torch.Tensor], torch.Tensor]  # (C, ...) -> (R, ...): a slot's value per cache row

    def roots(self, s: Slots) -> np.ndarray | None:
        """(C,) bool on the host: active slots whose root ends an image row; None when none does."""
        w = self.width
        eol = s.active & (s.host_count >= 1) & ((s.host_count - 1) % w == w - 1) & (s.host_count < self.n_tokens)
        return eol if eol.any() else None

    def within_row(self, plan: RoundPlan, s: Slots) -> RoundPlan | None:
        """Cap each slot's depth so no drafted node ends an image row: nodes sit at indices
        root + 1 .. (the next row end) - 1, so no forced token falls inside a tree."""
        w = self.width
        cap = (w - 1 - s.host_count % w) % w  # host_count = root index + 1
        depth = np.minimum(plan.depth, cap)
        if depth.max(initial=0) <= 0:
            return None
        return replace(plan, depth=depth, levels=min(plan.levels, int(depth.max())))

    def with_companion(self, tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
                       eol: torch.Tensor):
        """Insert the companion entry after the root (column 1): ids (R, S), positions (R, S),
        tree mask (C, S, S) or None -> (R, S + 1), (R, S + 1), (C, S + 1, S + 1) (a causal
        (S + 1, S + 1) mask without a tree)."""
        r_eol = self.rows(eol)  # (R,)
        comp = torch.where(r_eol, self.eol_id, tokens[:, 0])[:, None]
        tokens = torch.cat([tokens[:, :1], comp, tokens[:, 1:]], 1)
        pos = torch.cat([pos[:, :1], pos[:, :1] + 1, pos[:, 1:]], 1)
        c, s = eol.shape[0], pos.shape[1]
        if mask is None:
            return tokens, pos, torch.ones(s, s, dtype=torch.bool, device=pos.device).tril()
        m = torch.zeros(c, s, s, dtype=torch.bool, device=mask.device)
        keep = torch.tensor([0] + list(range(2, s)), device=mask.device)
        m[:, keep[:, None], keep[None, :]] = mask
        m[:, 1, :2] = True  # the companion sees the root and itself
        m[:, 2:, 1] = eol[:, None]  # every node sees a real end-of-line (never a padding one)
        return tokens, pos, m

    @staticmethod
    def root_entry(x: torch.Tensor, r_eol: torch.Tensor) -> torch.Tensor:
        """(R, S + 1, ...) with a companion -> (R, S, ...): the companion's output stands for the
        root's where it is an end-of-line."""
        first = torch.where(r_eol.view(-1, *[1] * (x.dim() - 1)), x[:, 1:2], x[:, :1])
        return torch.cat([first, x[:, 2:]], 1)

    def cache_index(self, path: torch.Tensor, eol: torch.Tensor) -> torch.Tensor:
        """Kept entries (C, D + 2) of a round's forward with companions (root, companion, nodes:
        tree index i at entry i + 1) from the accepted path (C, D + 1); a real companion is kept,
        a padding one dropped."""
        shifted = torch.where(path > 0, path + 1, 0)
        pad = torch.zeros_like(shifted[:, :1])
        return torch.where(eol[:, None], torch.cat([pad, pad + 1, shifted[:, 1:]], 1), torch.cat([shifted, pad], 1))
