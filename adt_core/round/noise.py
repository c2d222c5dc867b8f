"""Counter-based noise for coupled (Gumbel-max) sampling.

Every uniform u(seed, position, token) is a pure function of its three integers: a 32-bit
integer hash (Wellons' "lowbias32" mixer) chained over the seed's two 32-bit halves, the image
position and the token id, computed with int64 tensor ops whose intermediate products stay
below 2^49, so no operation overflows and CPU and CUDA give the same bits. No generator state:
the same (seed, position, token) gives the same value whatever the batch, the device or the
order of calls, which is what makes sampled output independent of the drafter, the tree shape
and the batch composition.

    g(seed, i, v) = -log(-log u(seed, i, v))      # Gumbel(0, 1)
    y_i = argmax_v (warped logits_i(v) + g(seed, i, v))   # an exact sample from softmax(warped)
"""

from __future__ import annotations

import functools

import torch

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers
_TOKEN_SALT, _POS_SALT = 0x9E3779B9, 0x85EBCA6B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and a 32-bit constant, without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective avalanche mix of 32-bit values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def seed_keys(seeds: torch.Tensor) -> torch.Tensor:
    """(B,) int64 seeds in [0, 2^63) -> (B,) 32-bit keys mixing both halves (an image's key is
    computed once, when it is admitted: `Slots.keys`)."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return mix32(mix32(lo) ^ hi)


@functools.lru_cache(maxsize=None)
def _token_mix(vocab: int, device: str) -> torch.Tensor:
    """(V,) the mixed token ids, computed once per vocabulary size and device."""
    return mix32((torch.arange(vocab, device=device, dtype=torch.long) + _TOKEN_SALT) & _MASK32)


def keyed_uniforms(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys (B,) (`seed_keys`), positions (B, P) image indices -> (B, P, V) float64 uniforms in (0, 1)."""
    pk = mix32(keys[:, None] ^ mix32((positions.long() + _POS_SALT) & _MASK32))  # (B, P)
    h = mix32(pk[..., None] ^ _token_mix(vocab, str(positions.device)))  # (B, P, V) 32-bit
    return (h.double() + 0.5) / 2.0**32


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds (B,), positions (B, P) image indices -> (B, P, V) float64 uniforms in (0, 1)."""
    return keyed_uniforms(seed_keys(seeds.to(positions.device, torch.long)), positions, vocab)


def keyed_gumbel(keys: torch.Tensor, positions: torch.Tensor, vocab: int, dtype=torch.float32) -> torch.Tensor:
    """keys (B,) (`seed_keys`), positions (B, P) -> (B, P, V) Gumbel(0, 1) noise."""
    u = keyed_uniforms(keys, positions, vocab)
    return (-torch.log(-torch.log(u))).to(dtype)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, dtype=torch.float32) -> torch.Tensor:
    """seeds (B,), positions (B, P) -> (B, P, V) Gumbel(0, 1) noise, fixed per (seed, position, token)."""
    return keyed_gumbel(seed_keys(seeds.to(positions.device, torch.long)), positions, vocab, dtype)
