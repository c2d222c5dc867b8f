"""Memory plan: how many images one device decodes at once.

    free      = device - reserve - weights - workspace
    per image = target KV + drafter KV + tree logits + draft window (jacobi)
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

from adt_core.families.contract import full_res_channels
from adt_core.round.planners import extent
from adt_core.round.state import Extent

GB = 10**9


def _size(n: int) -> str:
    for unit, scale in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


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
    window_per_image: int = 0  # jacobi's window of candidates ahead of the prefix (adt_core/round/jacobi.py)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def per_image(self) -> int:
        return self.target_kv_per_image + self.drafter_kv_per_image + self.tree_per_image + self.window_per_image

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
            f"{self.drafter_kv_per_image / GB:.3f} + tree {self.tree_per_image / GB:.3f} + window "
            f"{self.window_per_image / GB:.3f}",
        ])

    __str__ = describe

    def line(self) -> str:
        """The plan in one line (start-up consoles and logs)."""
        cap = "uncapped" if self.batch_size is None else f"decode.batch_size {self.batch_size}"
        return (f"memory plan: {self.images} image(s) in flight on a {self.device_bytes / GB:.1f} GB device "
                f"(memory fits {self.fits}; {cap}): weights {_size(self.weights_total)}, per image "
                f"{_size(self.per_image)} = KV {_size(self.target_kv_per_image)} ({self.rows_per_image} rows x "
                f"{self.tokens_per_row} tokens) + drafter KV {_size(self.drafter_kv_per_image)} + tree "
                f"{_size(self.tree_per_image)} + window {_size(self.window_per_image)}; reserve {_size(self.reserve_bytes)}")

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
    drafter_tokens: int | None = None,
    window_bytes: int = 0,
    target_tokens: int | None = None,
) -> MemoryPlan:
    """Images in flight for one device.

    tokens: the longest row without a tree (max prompt tokens + generated tokens, forced ones
    included); tree_nodes / tree_depth: the largest draft tree (0 for AR); logits_width: the
    columns of a logits row (the number of image codes); drafter_tokens: the drafter cache's
    row length when the caller knows it (else tokens + every level of the tree); target_tokens: the
    target cache's row length when the caller knows it (else tokens + the tree); window_bytes:
    a drafter-free method's draft window per image (jacobi; its trees need no drafter). Raises
    MemoryPlanError when not one image fits."""
    if not 0.0 <= reserve_fraction < 1.0:
        raise ValueError(f"reserve_fraction {reserve_fraction} not in [0, 1)")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size {batch_size} < 1")
    rows = 2 if cfg else 1
    spec = tree_nodes > 0
    length = target_tokens if target_tokens is not None else tokens + (tree_nodes + 1 if spec else 0)
    target_kv = target.bytes(rows, length, dtype_bytes)
    if drafter_tokens is None:
        drafter_tokens = tokens + (tree_depth + 1) * (tree_nodes + 1)
    drafter_kv = drafter.bytes(rows, drafter_tokens, dtype_bytes) if spec and drafter is not None else 0
    tree = 2 * rows * (tree_nodes + 1) * logits_width * 4 if spec else rows * logits_width * 4
    plan = dict(device_bytes=int(device_bytes), reserve_bytes=int(device_bytes * reserve_fraction),
                weights=dict(weights), workspace_bytes=int(workspace_bytes), rows_per_image=rows,
                tokens_per_row=length, target_kv_per_image=target_kv, drafter_kv_per_image=drafter_kv,
                tree_per_image=tree, batch_size=batch_size, window_per_image=int(window_bytes) if spec else 0)
    probe = MemoryPlan(**plan, fits=0, images=0)
    fits = max(0, probe.free_bytes // probe.per_image)
    if fits < 1:
        raise MemoryPlanError(
            f"not one image fits: the {device_bytes / GB:.1f} GB device leaves {max(probe.free_bytes, 0) / GB:.2f} GB "
            f"after weights ({probe.weights_total / GB:.2f} GB), reserve and workspace, and one image needs "
            f"{probe.per_image / GB:.2f} GB ({rows} rows x {length} tokens of KV); use a larger device, "
            "a shorter prompt limit or a smaller image")
    return MemoryPlan(**plan, fits=int(fits), images=int(min(fits, batch_size or fits)))


# ---- a bundle and a decode config ---------------------------------------------------------
VQ_LIVE_MAPS = 4  # full-resolution feature maps alive at once in a VQ decoder res block (estimate)


def kv_shape(model) -> KVShape:
    """Layers and kv width of any family's target or drafter, from its own `new_cache` (contract)."""
    cache = model.new_cache(1, 1, device="meta")
    layers, _, heads, _, head_dim = cache.k.shape  # (L, R, heads, max_len, hd)
    return KVShape(int(layers), int(heads * head_dim))


def _numel(m: torch.nn.Module) -> int:
    return sum(t.numel() for t in [*m.parameters(), *m.buffers()])


def decode_workspace(decoder, grid: tuple[int, int]) -> int:
    """fp32 activations of decoding one image to pixels (an estimate: a few feature maps of the
    decoder's full-resolution level)."""
    ch = full_res_channels(decoder)
    if ch is None:
        return 0
    f = decoder.downsample_factor
    return VQ_LIVE_MAPS * ch * grid[0] * f * grid[1] * f * 4


def bundle_plan(bundle, config, device_bytes: int, reserve_fraction: float = 0.08) -> MemoryPlan:
    """The memory plan of decoding `bundle` (any family; weights may sit on the meta device)
    with a DecodeConfig on one device of `device_bytes`.

    Weights as Generator places them (target and drafter at config.dtype, the decoder in fp32,
    a text encoder module at its own size); per image the caches BatchDecoder allocates: each
    cfg row holds the longest prompt (the prompter's `max_prompt`),
    every generated entry up to the last code, and the widest tree; the drafter's cache holds the
    same plus what one round feeds it. decode.batch_size caps the images in flight."""
    from adt_core.engine import DTYPES

    size = torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    weights = {"target": _numel(bundle.target) * size}
    if bundle.drafter is not None:  # placed on the device for every method
        weights["drafter"] = _numel(bundle.drafter) * size
    weights["vq"] = _numel(bundle.vq) * 4
    if isinstance(bundle.text_encoder, torch.nn.Module):
        weights["text_encoder"] = sum(t.numel() * t.element_size()
                                      for t in [*bundle.text_encoder.parameters(), *bundle.text_encoder.buffers()])
    prompter = bundle.make_prompter()
    layout = prompter.layout
    n = layout.num_codes if config.max_tokens is None else min(config.max_tokens, layout.num_codes)
    base = prompter.max_prompt
    span = int(layout.offset(n - 1)) + 1
    runs = bundle.drafter is not None or not config.needs_drafter  # a drafter method without one: plain steps
    ext = extent(config) if runs else Extent(0, 0)  # the planner's, as the decoder sizes its caches
    widest = ext.nodes
    spec = widest > 0
    drafter = kv_shape(bundle.drafter) if spec and config.needs_drafter else None
    sampling = config.sampling(bundle.sampling)
    window = 0
    if spec and not config.needs_drafter:
        from adt_core.round.jacobi import window_bytes

        window = window_bytes(config, prompter.vocab.num_codes, config.sampler == "rejection" and not sampling.greedy)
    return plan_memory(
        device_bytes, weights, kv_shape(bundle.target), base + span, cfg=sampling.use_cfg,
        dtype_bytes=size, drafter=drafter, tree_nodes=widest,
        logits_width=prompter.vocab.num_codes, workspace_bytes=decode_workspace(bundle.vq, (layout.grid_h, layout.grid_w)),
        batch_size=config.batch_size, reserve_fraction=reserve_fraction,
        drafter_tokens=ext.drafter_len(base + span) if drafter is not None else None, window_bytes=window,
        target_tokens=ext.target_len(base + span))
