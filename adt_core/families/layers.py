"""Layers the families share: RMSNorm, the SwiGLU MLP, 1-D rotate-half RoPE (Chameleon, Janus)
and LlamaGen's 2-D RoPE.

2-D rotary position embedding as LlamaGen uses it for text-to-image.

Sequence layout: `cls_len` caption positions, then image tokens in raster order. Image token k
sits at grid (k // W, k % W) and rotates its head_dim/2 interleaved pairs by the angles
[row * f (head_dim/4 values), col * f (head_dim/4 values)], f_i = base^(-2i / (head_dim/2)).
Caption positions get cos = sin = 0 (not the identity), so their q and k are exactly zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
