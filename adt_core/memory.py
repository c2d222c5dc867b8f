"""Memory plan: how many images one device decodes at once.

    free      = device - reserve - weights - workspace
    per image = target KV + drafter KV + tree logits
    in flight = min(free // per image, decode.batch_size)

KV bytes of a model for one image = rows x layers x 2 (keys, values) x kv width (kv heads x
head_dim) x tokens x dtype bytes, where rows = 2 with classifier-free guidance and tokens is
the longest row the cache must hold: prompt + every generated token (codes and forced tokens)
+ tree headroom. The KV cache gives every row the same length, so a shorter uncond row costs
as much as the cond row. Tree headroom: the target caches one tree (nodes + root) past the
committed sequence; the drafter caches every level of its tree (EAGLE-2 drafting). Workspace
is one-at-a-time work (decoding one image to pixels); reserve is the share of the device kept
free for activations, allocator slack and the CUDA context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

GB = 10**9


class MemoryPlanError(ValueError):
    """Not even one image fits the device."""


@dataclass(frozen=True)
class KVShape:
    layers: int  # decoder layers with a KV cache
    width: int  # kv_heads * head_dim: keys (and values) per token per layer

    def bytes(self, rows: int, tokens: int, dtype_bytes: int) -> int:
        return rows * self.layers * 2 * self.width * tokens * dtype_bytes


def module_bytes(factory: Callable[[], torch.nn.Module], dtype_bytes: int) -> int:
    """Parameter + buffer bytes of a module built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        m = factory()
    return sum(t.numel() for t in [*m.parameters(), *m.buffers()]) * dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    device_bytes: int
    reserve_bytes: int  # kept free: activations, allocator slack, CUDA context
    weights: dict[str, int]  # bytes per model held on the device
    workspace_bytes: int  # one-at-a-time work (e.g. decoding one image to pixels)
    rows_per_image: int  # 2 with CFG (cond + uncond), else 1
    tokens_per_row: int  # cache length per row: prompt + generated + target tree headroom
    target_kv_per_image: int
    drafter_kv_per_image: int
    tree_per_image: int  # fp32 logits of one verify step and one draft level
    fits: int  # images the device holds
    batch_size: int | None  # decode.batch_size (the cap), None = uncapped
    images: int  # in flight: min(fits, batch_size)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def per_image(self) -> int:
        return self.target_kv_per_image + self.drafter_kv_per_image + self.tree_per_image

    @property
    def free_bytes(self) -> int:
        return self.device_bytes - self.reserve_bytes - self.weights_total - self.workspace_bytes

    def describe(self) -> str:
        cap = "uncapped" if self.batch_size is None else f"decode.batch_size {self.batch_size}"
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.weights.items())
        return "\n".join([
            f"memory plan: {self.images} images in flight on a {self.device_bytes / GB:.1f} GB device "
            f"(memory fits {self.fits}; {cap})",
            f"  weights    {self.weights_total / GB:7.2f} GB ({parts})",
            f"  reserve    {self.reserve_bytes / GB:7.2f} GB   workspace {self.workspace_bytes / GB:.2f} GB",
            f"  per image  {self.per_image / GB:7.3f} GB = target KV {self.target_kv_per_image / GB:.3f} "
            f"({self.rows_per_image} rows x {self.tokens_per_row} tokens) + drafter KV "
            f"{self.drafter_kv_per_image / GB:.3f} + tree {self.tree_per_image / GB:.3f}",
        ])

    __str__ = describe

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(weights_total=self.weights_total, per_image=self.per_image, free_bytes=self.free_bytes)
        return d


def plan_memory(
    device_bytes: int,
    weights: Mapping[str, int],
    target: KVShape,
    tokens: int,
    cfg: bool = True,
    dtype_bytes: int = 2,
    drafter: KVShape | None = None,
    tree_nodes: int = 0,
    tree_depth: int = 0,
    logits_width: int = 0,
    workspace_bytes: int = 0,
    batch_size: int | None = None,
    reserve_fraction: float = 0.08,
) -> MemoryPlan:
    """Images in flight for one device.

    tokens: the longest row without a tree (max prompt tokens + generated tokens, forced ones
    included); tree_nodes / tree_depth: the largest draft tree (0 for AR); logits_width: the
    columns of a logits row (the number of image codes). Raises MemoryPlanError when not one
    image fits."""
    if not 0.0 <= reserve_fraction < 1.0:
        raise ValueError(f"reserve_fraction {reserve_fraction} not in [0, 1)")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size {batch_size} < 1")
    rows = 2 if cfg else 1
    spec = drafter is not None and tree_nodes > 0
    length = tokens + (tree_nodes + 1 if spec else 0)
    target_kv = target.bytes(rows, length, dtype_bytes)
    drafter_kv = drafter.bytes(rows, tokens + (tree_depth + 1) * (tree_nodes + 1), dtype_bytes) if spec else 0
    tree = 2 * rows * (tree_nodes + 1) * logits_width * 4 if spec else rows * logits_width * 4
    plan = dict(device_bytes=int(device_bytes), reserve_bytes=int(device_bytes * reserve_fraction),
                weights=dict(weights), workspace_bytes=int(workspace_bytes), rows_per_image=rows,
                tokens_per_row=length, target_kv_per_image=target_kv, drafter_kv_per_image=drafter_kv,
                tree_per_image=tree, batch_size=batch_size)
    probe = MemoryPlan(**plan, fits=0, images=0)
    fits = max(0, probe.free_bytes // probe.per_image)
    if fits < 1:
        raise MemoryPlanError(
            f"not one image fits: the {device_bytes / GB:.1f} GB device leaves {max(probe.free_bytes, 0) / GB:.2f} GB "
            f"after weights ({probe.weights_total / GB:.2f} GB), reserve and workspace, and one image needs "
            f"{probe.per_image / GB:.2f} GB ({rows} rows x {length} tokens of KV); use a larger device, "
            "a shorter prompt limit or a smaller image")
    return MemoryPlan(**plan, fits=int(fits), images=int(min(fits, batch_size or fits)))
