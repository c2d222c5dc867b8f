"""Layers the families share: RoPE (LlamaGen's 2-D interleaved pairs, the 1-D rotate-half of
Chameleon and Janus), RMSNorm, the SwiGLU MLP, one attention (fused or split qkv, optional
qk-norm, GQA), the Llama decoder layer and EAGLE's draft head.

Every layer takes positions (as a `Rotary`), the attention mask and the KV cache as arguments,
never as attributes. Submodule names are the checkpoints' own, so state-dict keys are the files'
keys: split projections and the Llama layer use transformers' names (q_proj .. o_proj, gate_proj
.. down_proj, self_attn, mlp, input_layernorm, post_attention_layernorm); a fused attention uses
LlamaGen's (wqkv, wo) and an MLP takes LlamaGen's (w1, w3, w2) when told.

2-D rotary position embedding as LlamaGen uses it for text-to-image.

Sequence layout: `cls_len` caption positions, then image tokens in raster order. Image token k
sits at grid (k // W, k % W) and rotates its head_dim/2 interleaved pairs by the angles
[row * f (head_dim/4 values), col * f (head_dim/4 values)], f_i = base^(-2i / (head_dim/2)).
Caption positions get cos = sin = 0 (not the identity), so their q and k are exactly zero.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from adt_core.kv_cache import KVCache

# q or k (R, S, heads, hd) -> the same, rotated at the tokens' positions (built once per forward)
Rotary = Callable[[torch.Tensor], torch.Tensor]
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")  # transformers' SwiGLU names (gate, up, down)
LLAMAGEN_MLP = ("w1", "w3", "w2")  # LlamaGen's


# ---- RoPE ---------------------------------------------------------------------------------


def build_rope_cache(grid_h: int, grid_w: int, cls_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Returns (cls_len + grid_h * grid_w, head_dim // 2, 2) float32: [..., 0] = cos, [..., 1] = sin."""
    if head_dim % 4 != 0:
        raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {head_dim}")
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.float64)[: half // 2] / half))  # (hd/4,)
    rows = torch.arange(grid_h, dtype=torch.float64)[:, None] * freqs  # (H, hd/4)
    cols = torch.arange(grid_w, dtype=torch.float64)[:, None] * freqs  # (W, hd/4)
    angles = torch.cat(
        [rows[:, None, :].expand(grid_h, grid_w, -1), cols[None, :, :].expand(grid_h, grid_w, -1)], dim=-1
    ).reshape(grid_h * grid_w, half)  # (H*W, hd/2)
    grid = torch.stack([angles.cos(), angles.sin()], dim=-1).float()  # (H*W, hd/2, 2)
    caption = torch.zeros(cls_len, half, 2)
    return torch.cat([caption, grid], dim=0)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (B, S, heads, hd); rope: (B, S, hd/2, 2) gathered at the tokens' positions.

    Pair (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin): one complex product per pair, in fp32.
    """
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, S, heads, hd/2)
    rc = torch.view_as_complex(rope.contiguous())[:, :, None]  # (B, S, 1, hd/2)
    return torch.view_as_real(xc * rc).flatten(-2).type_as(x)


class RopeTable:
    """The fp32 table of `build_rope_cache`, kept out of the module's buffers so that casting a
    model to bf16 never rounds the angles; copied once per device on first use."""

    def __init__(self, grid_h: int, grid_w: int, cls_len: int, head_dim: int, base: float = 10000.0) -> None:
        with torch.device("cpu"):  # real numbers even when the model is built on the meta device
            self.table = build_rope_cache(grid_h, grid_w, cls_len, head_dim, base)  # (T + H*W, hd/2, 2)
        self._on: dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.table.shape[0]

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (B, S) -> (B, S, hd/2, 2) fp32."""
        dev = positions.device
        if dev not in self._on:
            self._on[dev] = self.table.to(dev)
        return self._on[dev][positions]

    def rotary(self, positions: torch.Tensor) -> Rotary:
        """positions (B, S) -> the rotation of q and k at them."""
        return partial(apply_rope, rope=self(positions))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (R, S) -> cos, sin (R, S, 1, head_dim) fp32 for rotate-half RoPE."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    freqs = positions[..., None].float() * inv  # (R, S, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]  # (R, S, 1, hd)
    return emb.cos(), emb.sin()


def apply_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (R, S, heads, hd): pairs (j, j + hd/2) rotate together (rotate-half), in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


def half_rotary(positions: torch.Tensor, head_dim: int, theta: float) -> Rotary:
    """positions (R, S) -> the rotate-half rotation of q and k at them."""
    cos, sin = rope_cos_sin(positions, head_dim, theta)
    return partial(apply_rotate_half, cos=cos, sin=sin)


# ---- norm, MLP, attention -----------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # in fp32, as LlamaGen
        return normed.type_as(x) * self.weight


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases. `names`: the (gate, up, down) submodule
    names of the checkpoint (LLAMA_MLP, or LlamaGen's LLAMAGEN_MLP)."""

    def __init__(self, dim: int, hidden: int, names: Sequence[str] = LLAMA_MLP) -> None:
        super().__init__()
        self.names = tuple(names)
        for name, (i, o) in zip(self.names, ((dim, hidden), (dim, hidden), (hidden, dim)), strict=True):
            self.add_module(name, nn.Linear(i, o, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self._modules[n] for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class Attention(nn.Module):
    """Causal-or-not attention over an explicit mask and KV cache, no biases.

    fused: one projection to q | k | v (LlamaGen's `wqkv`, output `wo`); else transformers'
    q_proj, k_proj, v_proj, o_proj. GQA: kv_heads divides heads; the cache holds kv_heads and
    each kv head serves heads // kv_heads consecutive query heads. qk_norm: modules applied to q
    and k (R, S, heads | kv_heads, hd) before RoPE (Chameleon's LayerNorm), kept as q_norm, k_norm.
    """

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None, fused: bool = False,
                 qk_norm: tuple[nn.Module, nn.Module] | None = None) -> None:
        super().__init__()
        kv_heads = kv_heads or heads
        if dim % heads or heads % kv_heads:
            raise ValueError(f"attention: {heads} heads must divide dim {dim} and be a multiple of {kv_heads} kv heads")
        self.heads, self.kv_heads, self.head_dim, self.fused = heads, kv_heads, dim // heads, fused
        q, kv = heads * self.head_dim, kv_heads * self.head_dim
        self.widths = (q, kv, kv)
        if fused:
            self.wqkv = nn.Linear(dim, q + 2 * kv, bias=False)
            self.wo = nn.Linear(q, dim, bias=False)
        else:
            self.q_proj = nn.Linear(dim, q, bias=False)
            self.k_proj = nn.Linear(dim, kv, bias=False)
            self.v_proj = nn.Linear(dim, kv, bias=False)
            self.o_proj = nn.Linear(q, dim, bias=False)
        self.q_norm, self.k_norm = qk_norm if qk_norm is not None else (None, None)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (R, S, dim) -> q (R, S, heads, hd), k and v (R, S, kv_heads, hd)."""
        r, s, _ = x.shape
        if self.fused:
            q, k, v = self.wqkv(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        hd = self.head_dim
        return q.view(r, s, self.heads, hd), k.view(r, s, self.kv_heads, hd), v.view(r, s, self.kv_heads, hd)

    def forward(self, x: torch.Tensor, rope: Rotary, mask: torch.Tensor, cache: KVCache | None,
                layer: int) -> torch.Tensor:
        """x (R, S, dim); mask (R, 1, S, K) bool, K = cached + S; cache layer `layer` gets k, v."""
        r, s, _ = x.shape
        q, k, v = self.qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q), rope(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (R, heads | kv, S, hd)
        if cache is not None:
            k, v = cache.write(layer, k, v)  # (R, kv, K, hd)
        if self.kv_heads != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (R, heads, S, hd)
        return (self.wo if self.fused else self.o_proj)(out.transpose(1, 2).reshape(r, s, -1))


# ---- layers and heads ---------------------------------------------------------------------
class DecoderLayer(nn.Module):
    """The Llama layer: x + attn(input_layernorm(x)), then h + mlp(post_attention_layernorm(h)).

    input_norm False drops the attention's input norm (EAGLE's first drafter layer, whose input
    is already the fc projection); swin moves both norms after their branch (Chameleon-34B)."""

    def __init__(self, attn: Attention, dim: int, ffn: int, eps: float, input_norm: bool = True,
                 swin: bool = False) -> None:
        super().__init__()
        self.swin = swin
        self.self_attn = attn
        self.mlp = MLP(dim, ffn)
        self.input_layernorm = RMSNorm(dim, eps) if input_norm else None
        self.post_attention_layernorm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, rope: Rotary, mask: torch.Tensor, cache: KVCache | None,
                layer: int) -> torch.Tensor:
        if self.swin:
            h = x + self.input_layernorm(self.self_attn(x, rope, mask, cache, layer))
            return h + self.post_attention_layernorm(self.mlp(h))
        a = self.input_layernorm(x) if self.input_layernorm is not None else x
        h = x + self.self_attn(a, rope, mask, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    """transformers' LlamaModel parts: embed_tokens, `depth` layers made by `layer` (built after
    the embedding: torch's random-init order), the final norm."""

    def __init__(self, vocab: int, dim: int, eps: float, layer: Callable[[], nn.Module], depth: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(layer() for _ in range(depth))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, rope: Rotary, mask: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Inputs (R, S, D) -> post-norm hidden states (R, S, D)."""
        return self.norm(run_layers(self.layers, x, rope, mask, cache))


class LlamaTarget(nn.Module):
    """The Target of a token family over a `LlamaBody` with rotate-half RoPE (Chameleon, Janus).

    A subclass holds `config` (num_hidden_layers, num_key_value_heads, head_dim, rope_theta),
    says where its body is (`body`), how ids are embedded (`embed`: the body's embed_tokens by
    default) and its `head` (logits over codes, fp32)."""

    @property
    def body(self) -> LlamaBody:
        raise NotImplementedError

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return half_rotary(positions, self.config.head_dim, self.config.rope_theta)

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache:
        p, c = self.body.embed_tokens.weight, self.config
        return KVCache(c.num_hidden_layers, rows, c.num_key_value_heads, c.head_dim, max_len,
                       device or p.device, dtype or p.dtype)

    def forward(self, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache | None = None,
                tokens: torch.Tensor | None = None, embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (R, S) or (S,); mask (R, 1, S, K) bool (K = cached + S); tokens (R, S) ids or
        embeds (R, S, D). Returns logits over image codes (R, S, V) fp32 and post-norm hidden (R, S, D)."""
        if (tokens is None) == (embeds is None):
            raise ValueError("forward needs exactly one of tokens or embeds")
        x = self.embed(tokens) if tokens is not None else embeds.to(self.body.embed_tokens.weight.dtype)
        hidden = self.body(x, self.rotary(as_rows(positions, x.shape[0])), mask, cache)
        return self.head(hidden), hidden


def as_rows(positions: torch.Tensor, rows: int) -> torch.Tensor:
    """positions (S,) shared by every row, or (R, S) -> (R, S)."""
    return positions[None].expand(rows, -1) if positions.dim() == 1 else positions


def run_layers(layers: nn.ModuleList, x: torch.Tensor, rope: Rotary, mask: torch.Tensor,
               cache: KVCache | None) -> torch.Tensor:
    """Layer i reads and writes cache layer i; the cache advances by the S new entries once."""
    for i, layer in enumerate(layers):
        x = layer(x, rope, mask, cache, i)
    if cache is not None:
        cache.advance(x.shape[1])
    return x


class EagleHead(nn.Module):
    """EAGLE's draft head. One input pair per sequence position p: the embedding of the id at p
    and the target's post-norm hidden state at p - 1 (which predicted that id). Then

        x = fc(concat(embed(id_p), h_{p-1}))    # (R, S, 2D) -> (R, S, D), with bias
        f = layers[0](x)                        # one decoder layer at p, no final norm
        logits = target.head(f)                 # the target's head (not held here)

    A family says how ids are embedded (`embed`: its own `embed_tokens` copy by default) and
    which RoPE runs at the positions (`rotary`). Built in LANTERN's / EAGLE's key order:
    embed_tokens (when held), fc, layers.0 (also torch's random-init order)."""

    def __init__(self, dim: int, kv_heads: int, head_dim: int, layer: Callable[[], nn.Module],
                 embed_tokens: nn.Embedding | None = None) -> None:
        super().__init__()
        if embed_tokens is not None:
            self.embed_tokens = embed_tokens
        self.fc = nn.Linear(2 * dim, dim, bias=True)
        self.layers = nn.ModuleList([layer()])
        self.cache_heads = (kv_heads, head_dim)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def rotary(self, positions: torch.Tensor) -> Rotary:
        raise NotImplementedError

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = self.fc.weight
        return KVCache(1, rows, *self.cache_heads, max_len, device or p.device, dtype or p.dtype)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens (R, S) ids at `positions` (R, S) or (S,); hidden (R, S, D) = target state one
        position earlier; mask (R, 1, S, K) bool. Returns features (R, S, D) for target.head."""
        dt = self.fc.weight.dtype
        x = self.fc(torch.cat([self.embed(tokens).to(dt), hidden.to(dt)], dim=-1))
        return run_layers(self.layers, x, self.rotary(as_rows(positions, x.shape[0])), mask, cache)
