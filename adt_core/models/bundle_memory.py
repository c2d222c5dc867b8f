"""What one GPU holds to decode with a LlamaGen bundle, from its configs alone.

`plan_memory` counts weights on the meta device (no weights needed) and sizes the KV caches
and logits per image in flight; `bundle_memory` does the same for a loaded bundle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from adt_core.models.bundle import Bundle
from adt_core.models.drafter import Drafter, DrafterConfig
from adt_core.models.gpt import GPTConfig, LlamaGenGPT
from adt_core.models.vq import VQConfig, VQModel

VQ_LIVE_MAPS = 4  # full-resolution activations alive at once in a VQ decoder res block (estimate)


def dtype_bytes(dtype: str | torch.dtype) -> int:
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # "bfloat16" -> torch.bfloat16
    return torch.empty((), dtype=dt).element_size()


def kv_cache_bytes(n_layer: int, n_head: int, head_dim: int, length: int, rows: int, dtype: str | torch.dtype) -> int:
    """Keys + values for `rows` sequences of `length` positions."""
    return 2 * n_layer * rows * n_head * head_dim * length * dtype_bytes(dtype)


@dataclass(frozen=True)
class MemoryPlan:
    """What one GPU holds to decode with a bundle. Bytes; per-image figures are per image in
    flight (vanilla AR batches B images at once; the speculative loop decodes one at a time)."""

    dtype: str
    rows_per_image: int  # 2 with classifier-free guidance (cond + uncond), else 1
    weights: dict[str, int]  # per component, as placed for decoding
    target_kv_per_image: int
    drafter_kv_per_image: int
    logits_per_image: int  # fp32 logits of the widest forward (caption prefill or tree verify)
    vq_decode_per_image: int = 0  # estimate: live fp32 activations of the VQ decoder at full resolution

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def per_image(self) -> int:
        """Decoding tokens and decoding pixels happen one after the other: the larger phase."""
        tokens = self.target_kv_per_image + self.drafter_kv_per_image + self.logits_per_image
        return max(tokens, self.vq_decode_per_image)

    def max_images(self, gpu_bytes: int, headroom: float = 0.15) -> int:
        """Images in flight that fit in `gpu_bytes` after weights, keeping `headroom` free."""
        free = gpu_bytes * (1.0 - headroom) - self.weights_total
        return max(0, int(free // self.per_image))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(weights_total=self.weights_total, per_image=self.per_image)
        return d


def _numel(factory) -> int:
    with torch.device("meta"):
        m = factory()
    return sum(t.numel() for t in list(m.parameters()) + list(m.buffers()))


def plan_memory(
    target: GPTConfig,
    drafter: DrafterConfig | None = None,
    vq: VQConfig | None = None,
    text_encoder_bytes: int = 0,
    dtype: str = "bfloat16",
    cfg: bool = True,
    tree_nodes: int = 58,
    depth: int = 5,
) -> MemoryPlan:
    """Memory of a bundle from its configs alone (meta-device counts; no weights needed).

    dtype: decoding dtype of target and drafter (their KV caches too); the VQ decoder runs in
    fp32. tree_nodes / depth: the largest draft tree (EAGLE-2: 58 nodes, 5 levels); 0 for AR.
    text_encoder_bytes: the text encoder's weights when it sits on the same GPU.
    """
    size = dtype_bytes(dtype)
    rows = 2 if cfg else 1
    t, n = target.cls_token_num, target.num_image_tokens
    spec = drafter is not None and tree_nodes > 0
    weights = {"target": _numel(lambda: LlamaGenGPT(target)) * size}
    if drafter is not None:
        weights["drafter"] = _numel(lambda: Drafter(drafter)) * size
    if vq is not None:
        weights["vq"] = _numel(lambda: VQModel(vq)) * 4
    if text_encoder_bytes:
        weights["text_encoder"] = int(text_encoder_bytes)
    extra = tree_nodes + 1 if spec else 0  # Generator: T + N + tree + 1 positions
    target_kv = kv_cache_bytes(target.n_layer, target.n_head, target.head_dim, t + n + extra, rows, dtype)
    drafter_kv = 0
    if spec:
        length = n + (depth + 1) * (tree_nodes + 1)  # Generator: committed pairs + every tree level's nodes
        drafter_kv = kv_cache_bytes(1, drafter.n_head, drafter.head_dim, length, rows, dtype)
    widest = max(t, tree_nodes + 1 if spec else 1)
    logits = rows * widest * target.vocab_size * 4
    vq_act = 0
    if vq is not None:  # ~4 live feature maps of the last decoder level (ch * ch_mult[0] wide) in fp32
        pixels = target.grid_h * target.grid_w * vq.downsample_factor**2
        vq_act = VQ_LIVE_MAPS * vq.ch * vq.ch_mult[0] * pixels * 4
    return MemoryPlan(dtype if isinstance(dtype, str) else str(dtype), rows, weights, target_kv, drafter_kv, logits,
                      vq_act)


def bundle_memory(bundle: Bundle, dtype: str = "bfloat16", cfg: bool | None = None, tree_nodes: int = 58,
                  depth: int = 5, text_encoder_on_gpu: bool = True) -> MemoryPlan:
    """`plan_memory` for a loaded bundle; cfg defaults to the bundle's sampling defaults and
    the text encoder counts at its actual size when it sits on the GPU."""
    text = bundle.component_bytes().get("text_encoder", 0) if text_encoder_on_gpu else 0
    return plan_memory(
        bundle.target.config, bundle.drafter.config if bundle.drafter is not None else None, bundle.vq.cfg,
        text_encoder_bytes=text, dtype=dtype, cfg=bundle.sampling.use_cfg if cfg is None else cfg,
        tree_nodes=tree_nodes, depth=depth,
    )
