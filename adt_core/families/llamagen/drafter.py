"""The EAGLE / LANTERN draft head for LlamaGen targets (adt_core/families/layers.py's EagleHead).

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
from torch import nn

from adt_core.families.layers import Attention, DecoderLayer, EagleHead, RopeTable, Rotary


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


class Drafter(EagleHead):
    def __init__(self, cfg: DrafterConfig) -> None:
        layer = lambda: DecoderLayer(Attention(cfg.dim, cfg.n_head), cfg.dim, cfg.ffn_dim, cfg.norm_eps,  # noqa: E731
                                     input_norm=False)
        super().__init__(cfg.dim, cfg.n_head, cfg.head_dim, layer, nn.Embedding(cfg.vocab_size, cfg.dim))
        self.config = cfg
        self.rope = RopeTable(cfg.grid_h, cfg.grid_w, cfg.cls_token_num, cfg.head_dim, cfg.rope_base)

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return self.rope.rotary(positions)
