"""Preallocated key/value cache that owns its length.

One cache serves one model (target or drafter) and a fixed set of rows (for CFG: the cond
rows then the uncond rows). A forward writes its S new entries at [length, length + S) in every
layer and then advances `length`. After tree verification `keep` compacts the accepted path in
place, so the cache always holds exactly the committed sequence.

`valid` marks key slots any query may attend to: caption padding slots are False (LlamaGen
masks padded caption keys for both CFG rows); every other written slot is True.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        n_layer: int,
        rows: int,
        n_head: int,
        head_dim: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (n_layer, rows, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, R, heads, max_len, hd)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.valid = torch.ones(rows, max_len, dtype=torch.bool, device=device)  # (R, max_len)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (R, heads, S, hd) at [length, length + S); return all keys/values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} > {self.max_len}")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def attn_mask(self, new_mask: torch.Tensor, since: int | None = None) -> torch.Tensor:
        """Attention mask (R, 1, S, length + S) for S new queries.

        Keys before `since` (default: all cached ones) are visible where `valid`; keys from
        `since` on (cached tree nodes, then the S new ones) follow `new_mask`, which is
        (S, length - since + S) or (R, S, length - since + S), True = may attend. A query always
        sees itself (so a padded caption row never has an empty row).
        """
        since = self.length if since is None else since
        s = new_mask.shape[-2]
        total = self.length + s
        if new_mask.shape[-1] != total - since:
            raise ValueError(f"new_mask covers {new_mask.shape[-1]} keys, expected {total - since}")
        head = self.valid[:, None, None, :since].expand(-1, 1, s, -1)  # (R, 1, S, since)
        tail = new_mask.to(self.valid.device).expand(self.rows, s, total - since)[:, None]  # (R, 1, S, ...)
        tail = tail & self.valid[:, None, None, since:total]
        mask = torch.cat([head, tail], dim=-1)
        diag = torch.arange(s, device=mask.device)
        mask[:, :, diag, self.length + diag] = True
        return mask

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep only slots start + idx (ascending) after `start`, compacted in place."""
        n = idx.numel()
        src = start + idx.to(self.k.device)
        self.k[:, :, :, start : start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start : start + n] = self.v.index_select(3, src)
        self.length = start + n

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot truncate to {length} > {self.length}")
        self.length = length
