"""Measured cost of one target forward as a function of the number of new tokens.

Speculative decoding pays off when verifying n tokens at once costs much less than n single
steps. On a GPU cost(n) is nearly flat up to large n; on a CPU it grows early. The cost-aware
budget (ADT-Tree, "cost" mode) reads this table, and `python -m jobs.bench --calibrate` prints it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from adt_core.models.gpt import LlamaGenGPT

SIZES = (1, 8, 16, 32, 64)


class Timer:
    """Wall-clock milliseconds that wait for the device to finish queued work."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() * 1000.0


@dataclass(frozen=True)
class CostTable:
    ms: dict[int, float]  # new tokens -> median milliseconds of one target forward
    draft_level_ms: float = 0.0  # one drafter level (a width-k frontier, all CFG rows, head + top-k)

    def ratio(self, n: int) -> float:
        return self.cost(n) / self.ms[min(self.ms)]

    def cost(self, n: int) -> float:
        """Milliseconds for n new tokens, linear between measured sizes (flat-extrapolated)."""
        xs = sorted(self.ms)
        if n <= xs[0]:
            return self.ms[xs[0]]
        for a, b in zip(xs, xs[1:]):
            if n <= b:
                return self.ms[a] + (self.ms[b] - self.ms[a]) * (n - a) / (b - a)
        a, b = xs[-2], xs[-1]
        return self.ms[b] + (self.ms[b] - self.ms[a]) * (n - b) / (b - a)


@torch.inference_mode()
def measure_target_cost(
    target: LlamaGenGPT,
    rows: int = 2,
    sizes: tuple[int, ...] = SIZES,
    prefix_len: int | None = None,
    repeats: int = 7,
    warmup: int = 2,
) -> CostTable:
    """Median time of a forward of n tree tokens on top of a cached prefix, per n in `sizes`.

    rows: 2 with classifier-free guidance (cond + uncond), else 1. prefix_len defaults to the
    captions plus half the image (a typical mid-image state).
    """
    cfg = target.config
    p = target.output.weight
    dev = p.device
    prefix = prefix_len if prefix_len is not None else cfg.cls_token_num + cfg.num_image_tokens // 2
    cache = target.new_cache(rows, prefix + max(sizes))
    timer = Timer(dev)
    toks = torch.randint(0, cfg.vocab_size, (rows, prefix + max(sizes)), device=dev)
    causal = lambda n: torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # noqa: E731
    target(torch.arange(prefix, device=dev), cache.attn_mask(causal(prefix)), cache,
           tokens=toks[:, :prefix])
    out: dict[int, float] = {}
    for n in sizes:
        pos = (prefix + torch.arange(n, device=dev)).clamp(max=len(target.rope) - 1)
        times = []
        for i in range(warmup + repeats):
            t0 = timer.now()
            target(pos, cache.attn_mask(causal(n)), cache, tokens=toks[:, prefix : prefix + n])
            t1 = timer.now()
            cache.truncate(prefix)
            if i >= warmup:
                times.append(t1 - t0)
        out[n] = statistics.median(times)
    return CostTable(out)


@torch.inference_mode()
def measure_draft_level(drafter, head, cfg_scale: float, rows: int, width: int = 10, levels: int = 5,
                        prefix_len: int = 128, repeats: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of one draft level: (time of a `levels`-level EAGLE-2 proposal minus a
    1-level one) / (levels - 1), through the real `TreeProposer` on a random prefix."""
    from adt_core.draft import TreeProposer

    cfg, w = drafter.config, drafter.fc.weight
    width = min(width, cfg.vocab_size)
    prefix = max(1, min(prefix_len, len(drafter.rope) - levels - 1))
    proposer = TreeProposer(drafter, head, cfg_scale, rows, prefix + 1 + levels * width)
    timer = Timer(w.device)
    hidden = torch.randn(rows, prefix + 1, cfg.dim, device=w.device, dtype=w.dtype)
    tokens = torch.randint(0, cfg.vocab_size, (prefix + 1,)).tolist()

    def one(depth: int) -> float:
        proposer.cache.truncate(0)
        proposer.observe(hidden[:, :prefix], tokens[:prefix], 0)
        proposer._feed_pending()  # the prefix; only the proposal below is timed
        proposer.observe(hidden[:, prefix:], tokens[prefix:], prefix)
        t0 = timer.now()
        proposer.propose_dynamic(tokens[-1], prefix, depth, width, budget=width * depth)
        return timer.now() - t0

    diffs = []
    for i in range(warmup + repeats):
        full, single = one(levels), one(1)
        if i >= warmup:
            diffs.append((full - single) / (levels - 1))
    return max(statistics.median(diffs), 0.0)
