"""Text encoders: prompts -> caption token states placed the LlamaGen way.

Every encoder returns `(emb (B, T, C) float32, mask (B, T) bool)` with the valid tokens moved
to the END of the T rows, padding rows zeroed, mask True where valid. The target masks padded
caption keys for both CFG rows.
"""

from __future__ import annotations

import re
import zlib
from typing import Protocol

import torch


class TextEncoder(Protocol):
    max_tokens: int
    dim: int

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


def place_at_end(states: list[torch.Tensor], max_tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """states: per prompt (n_i, dim) valid token states -> right-aligned (B, T, dim) + mask (B, T)."""
    emb = torch.zeros(len(states), max_tokens, dim)
    mask = torch.zeros(len(states), max_tokens, dtype=torch.bool)
    for i, s in enumerate(states):
        n = min(s.shape[0], max_tokens)
        if n:
            emb[i, max_tokens - n :] = s[:n].float()
            mask[i, max_tokens - n :] = True
    return emb, mask


class HashTextEncoder:
    """Deterministic test encoder: each word hashes (crc32) into a fixed random table.

    Not a language model; it gives random bundles distinct, stable captions without weights.
    """

    kind = "hash"

    def __init__(self, dim: int = 32, max_tokens: int = 8, table_size: int = 1024, seed: int = 0) -> None:
        self.dim, self.max_tokens, self.table_size, self.seed = dim, max_tokens, table_size, seed
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(table_size, dim, generator=g)  # (table, dim)

    def config(self) -> dict:
        return {"type": "hash", "dim": self.dim, "max_tokens": self.max_tokens, "table_size": self.table_size, "seed": self.seed}

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        states = []
        for p in prompts:
            words = re.findall(r"\w+", p.lower())[: self.max_tokens]
            ids = torch.tensor([zlib.crc32(w.encode()) % self.table_size for w in words], dtype=torch.long)
            states.append(self.table[ids])
        return place_at_end(states, self.max_tokens, self.dim)
