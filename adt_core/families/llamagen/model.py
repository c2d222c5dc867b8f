"""The LlamaGen text-to-image GPT (target model), at any size.

Architecture facts (../shared/design/model_formats.md): caption embedder MLP over `cls_token_num`
caption rows with an `uncond_embedding` buffer for classifier-free guidance; pre-norm blocks with
fused wqkv attention and a SwiGLU feed-forward; RMSNorm computed in fp32; untied output head;
2-D RoPE with zero rotation rows for caption positions. State-dict keys match LlamaGen's
original checkpoints.

`forward` is explicit: positions, attention mask and KV cache are arguments, never attributes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adt_core.families.layers import LLAMAGEN_MLP, MLP, Attention, RMSNorm, RopeTable, as_rows, run_layers
from adt_core.kv_cache import KVCache


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass(frozen=True)
class GPTConfig:
    dim: int = 1280
    n_layer: int = 36
    n_head: int = 20
    vocab_size: int = 16384
    cls_token_num: int = 120  # caption rows (LlamaGen: 120 FLAN-T5 tokens)
    caption_dim: int = 2048  # width of the text encoder's token states
    grid_h: int = 16
    grid_w: int = 16
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    multiple_of: int = 256  # FFN width is rounded up to this
    ffn_dim_multiplier: float | None = None
    caption_dropout: float = 0.1  # training only: rows replaced by uncond_embedding

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @property
    def num_image_tokens(self) -> int:
        return self.grid_h * self.grid_w

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def llamagen(cls, size: str = "XL", grid: int = 16, **kw) -> "GPTConfig":
        dims = {"B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1280, 36, 20), "XXL": (1536, 48, 24)}
        dim, n_layer, n_head = dims[size]
        return cls(dim=dim, n_layer=n_layer, n_head=n_head, grid_h=grid, grid_w=grid, **kw)


class CaptionMLP(nn.Module):
    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Projects caption token states; holds the (never trained) unconditional caption."""

    def __init__(self, caption_dim: int, dim: int, token_num: int) -> None:
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, captions: torch.Tensor) -> torch.Tensor:
        return self.cap_proj(captions)  # (B, T, caption_dim) -> (B, T, dim)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg.dim, cfg.n_head, fused=True)
        self.feed_forward = MLP(cfg.dim, cfg.ffn_dim, names=LLAMAGEN_MLP)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, mask, cache, layer):
        h = x + self.attention(self.attention_norm(x), rope, mask, cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaGenGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.cls_token_num)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = RopeTable(cfg.grid_h, cfg.grid_w, cfg.cls_token_num, cfg.head_dim, cfg.rope_base)

    @property
    def vocab(self):
        """The model contract's image vocabulary: every id is a code (id == code)."""
        from adt_core.families.llamagen.prompt import llamagen_vocab

        return llamagen_vocab(self.config.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return self.config.cls_token_num + self.config.num_image_tokens

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = self.output.weight
        return KVCache(
            self.config.n_layer, rows, self.config.n_head, self.config.head_dim, max_len,
            device or p.device, dtype or p.dtype,
        )

    def embed(self, tokens: torch.Tensor | None, captions: torch.Tensor | None) -> torch.Tensor:
        """Captions (B, T, caption_dim) first, then image tokens (B, S); returns (B, T + S, dim)."""
        parts = []
        if captions is not None:
            parts.append(self.cls_embedding(captions.to(self.output.weight.dtype)))
        if tokens is not None:
            parts.append(self.tok_embeddings(tokens))
        if not parts:
            raise ValueError("forward needs tokens or captions")
        return torch.cat(parts, dim=1)

    def forward(
        self,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None = None,
        tokens: torch.Tensor | None = None,
        captions: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (B, S) or (S,) sequence positions; mask: (B, 1, S, K) bool (K = cached + S).
        `embeds` is the model contract's name for the caption states (the prompt rows' inputs).

        Returns logits (B, S, vocab) in fp32 and post-norm hidden states (B, S, dim).
        """
        x = self.embed(tokens, captions if embeds is None else embeds)  # (B, S, dim)
        x = run_layers(self.layers, x, self.rope.rotary(as_rows(positions, x.shape[0])), mask, cache)
        hidden = self.norm(x)
        return self.output(hidden).float(), hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head alone (the drafter's features go through it)."""
        return self.output(hidden).float()
