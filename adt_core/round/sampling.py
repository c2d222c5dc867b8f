"""CFG mixing, logit warping and the two samplers.

Vocabulary used across the engine: `p` is the target's distribution after CFG mixing and
warping (temperature, top-k, top-p); `q` is the drafter's.

Samplers (`DecodeConfig.sampler`):
- "coupled" (default): Gumbel-max with noise fixed per (seed, image position, token) from
  `adt_core.round.noise`: y_i = argmax(warped logits_i + g_i). An exact draw from p_i, and the same
  draw whichever method, tree or batch produced the logits (see verify.verify_coupled).
- "rejection": a per-image `torch.Generator` drives multinomial draws and the recursive
  rejection of verify.verify_stochastic (lossless in distribution only).
Greedy (temperature 0) is the argmax under both: no noise.
"""

from __future__ import annotations

import torch

from adt_core.config import SamplingConfig


def cfg_mix(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """logits (2B, ..., V) = [cond rows; uncond rows] -> (B, ..., V): uncond + s * (cond - uncond).

    With scale 1 there is no uncond half: logits are returned unchanged.
    """
    if scale == 1.0:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + scale * (cond - uncond)


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p on (..., V) fp32 logits; removed entries become -inf."""
    logits = logits.float() / cfg.temperature
    v = logits.shape[-1]
    if 0 < cfg.top_k < v:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token only when the mass strictly before it EXCEEDS top_p (LlamaGen's boundary;
        # the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) > cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """p: mixed logits (..., V) -> warped probabilities (..., V)."""
    return warp(logits, cfg).softmax(-1)


def perturbed(mixed_logits: torch.Tensor, cfg: SamplingConfig, noise: torch.Tensor | None) -> torch.Tensor:
    """Coupled sampling scores: mixed (..., V) + Gumbel noise (..., V) -> (..., V) fp32.

    argmax of the result is the coupled sample y; greedy (or noise None) is the plain logits.
    """
    if cfg.greedy or noise is None:
        return mixed_logits.float()
    return warp(mixed_logits, cfg) + noise.to(torch.float32)
