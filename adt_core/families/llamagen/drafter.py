"""The EAGLE / LANTERN draft head for LlamaGen targets.

One input pair per sequence position p: the embedding of the token at p and the target's
post-norm hidden state at p - 1 (which predicted that token). Then

    x = fc(concat(embed(token_p), h_{p-1}))      # (B, S, 2*dim) -> (B, S, dim)
    x = x + attn(x)                              # no input norm (EAGLE's first layer)
    f = x + mlp(post_attention_layernorm(x))     # no final norm: f regresses h_p
    logits = target.output(f)                    # the target's head, not the drafter's

The drafter uses the same 2-D RoPE as the target, at position p. Key names follow LANTERN's
checkpoints (embed_tokens, fc, layers.0.self_attn.*, layers.0.mlp.*, post_attention_layernorm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adt_core.families.layers import MLP, RopeTable, apply_rope  # noqa: F401 - MLP re-exported
from adt_core.families.layers import RMSNorm
from adt_core.kv_cache import KVCache


@dataclass(frozen=True)
class DrafterConfig:
    dim: int = 1280
    n_head: int = 20
    ffn_dim: int = 3584
    vocab_size: int = 16384
    cls_token_num: int = 120
    grid_h: int = 16
    grid_w: int = 16
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    # LANTERN's drafters also read one pair per caption position before the first image token:
    # (embedding of code 0, target hidden at caption position j) at position j + 1, unmasked.
    caption_pairs: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, t) -> "DrafterConfig":
        """A drafter matching a GPTConfig's widths, grid and vocabulary."""
        return cls(
            dim=t.dim, n_head=t.n_head, ffn_dim=t.ffn_dim, vocab_size=t.vocab_size,
            cls_token_num=t.cls_token_num, grid_h=t.grid_h, grid_w=t.grid_w, rope_base=t.rope_base,
        )


class SelfAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, rope, mask, cache: KVCache | None):
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, self.n_head, self.head_dim)  # noqa: E731
        q = apply_rope(split(self.q_proj(x)), rope).transpose(1, 2)  # (B, heads, S, hd)
        k = apply_rope(split(self.k_proj(x)), rope).transpose(1, 2)
        v = split(self.v_proj(x)).transpose(1, 2)
        if cache is not None:
            k, v = cache.write(0, k, v)  # (B, heads, length + S, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, mask, cache):
        h = x + self.self_attn(x, rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        self.layers = nn.ModuleList([DrafterLayer(cfg)])
        self.rope = RopeTable(cfg.grid_h, cfg.grid_w, cfg.cls_token_num, cfg.head_dim, cfg.rope_base)

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = self.fc.weight
        return KVCache(1, rows, self.config.n_head, self.config.head_dim, max_len, device or p.device, dtype or p.dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) at `positions`; hidden (B, S, dim) = target state one position earlier.

        mask: (B, 1, S, K) bool. Returns features (B, S, dim) that regress the target's hidden.
        """
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden.to(self.fc.weight.dtype)], dim=-1))
        if positions.dim() == 1:
            positions = positions[None].expand(x.shape[0], -1)
        x = self.layers[0](x, self.rope(positions), mask, cache)
        if cache is not None:
            cache.advance(x.shape[1])
        return x
