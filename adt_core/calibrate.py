"""Measured cost of target forwards and draft levels as a function of the tokens they carry.

Speculative decoding pays off when verifying n tokens at once costs much less than n single
steps. On a GPU cost(n) is nearly flat up to large n; on a CPU it grows early, and with many
images in flight a forward is already wide before any draft token is added. Both tables are
keyed by the TOTAL new tokens of one forward over every slot in flight (per CFG pair: with
guidance each token runs on a cond and an uncond row), measured with up to `slots` slots of
equal width on a mid-image prefix. The batch cost budget (adt_core/round/budget.py) reads them;
`python -m jobs.bench --calibrate` prints them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from adt_core.families.contract import Drafter, Prompter, Target, max_position

SIZES = (1, 8, 16, 32, 64)


class Timer:
    """Wall-clock milliseconds that wait for the device to finish queued work; `cpu=True` on a
    CPU device: this process's CPU milliseconds instead (what the work itself cost)."""

    def __init__(self, device: torch.device, cpu: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.clock = time.process_time if cpu and not self.cuda else time.perf_counter

    def now(self) -> float:
        """Milliseconds once queued device work is done (waits for a GPU: one host sync)."""
        if self.cuda:
            torch.cuda.synchronize()
        return self.clock() * 1000.0

    def mark(self) -> float:
        """Milliseconds now, without waiting for the device (exact on a CPU; on a GPU the time
        work was queued by, so a round's split between drafting and verifying is approximate)."""
        return time.perf_counter() * 1000.0


def _interp(table: dict[int, float], n: float) -> float:
    """Linear between measured sizes; past the largest, linear at the last segment's slope or
    the slope from the middle size to the largest, whichever is steeper (one reading slowed by
    other work, the second-largest, must not make far wider forwards look nearly free: a
    64-slot table whose two largest sizes read alike rated 64-node trees as cheap as 9-node ones)."""
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return table[a] + (table[b] - table[a]) * (n - a) / (b - a)
    if len(xs) == 1:
        return table[xs[0]] * n / xs[0]
    a, b = xs[-2], xs[-1]
    m = xs[(len(xs) - 1) // 2]
    slope = max((table[b] - table[a]) / (b - a), (table[b] - table[m]) / (b - m))
    return table[b] + slope * (n - b)


@dataclass(frozen=True)
class CostTable:
    ms: dict[int, float]  # total new tokens in one target forward -> milliseconds (fastest of a few)
    draft_level_ms: float = 0.0  # one draft level of the calibration width for one slot
    draft: dict[int, float] = field(default_factory=dict)  # total frontier tokens of one draft level -> ms
    # ms a plain step pays per cached key per cache row (its attention's growth with the longest
    # row): what a batch whose rows are ragged pays over one whose rows grow in lockstep (`key_cost`)
    key_ms: float = 0.0
    # a forward of q new tokens per row pays key_ms x (1 + key_slope x (q - 1)) per cached key per row
    # (attention reads a row's keys once per block of its queries: at the stand-in's B 64 on a CPU 1.7x
    # key_ms for 4 queries, not 4x)
    key_slope: float = 0.0
    prefix: int = 0  # cached entries per row the forwards in `ms` read (`typical_prefix`; 0: not known)

    def ratio(self, n: int) -> float:
        return self.cost(n) / self.ms[min(self.ms)]

    def cost(self, n: float) -> float:
        """Milliseconds of a target forward carrying n new tokens in total."""
        return _interp(self.ms, n)

    def draft_cost(self, n: float) -> float:
        """Milliseconds of one drafter level over n frontier tokens in total (0 tokens: free)."""
        if n <= 0:
            return 0.0
        return _interp(self.draft, n) if self.draft else self.draft_level_ms

    def to_json(self) -> str:
        return json.dumps({"ms": self.ms, "draft_level_ms": self.draft_level_ms, "draft": self.draft,
                           "key_ms": self.key_ms, "key_slope": self.key_slope, "prefix": self.prefix}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CostTable":
        d = json.loads(text)
        return cls({int(k): float(v) for k, v in d["ms"].items()}, float(d.get("draft_level_ms", 0.0)),
                   {int(k): float(v) for k, v in d.get("draft", {}).items()}, float(d.get("key_ms", 0.0)),
                   float(d.get("key_slope", 0.0)), int(d.get("prefix", 0)))

    def key_growth(self, q: float) -> float:
        """ms per cached key per row of a forward with q new tokens per row."""
        return self.key_ms * (1.0 + self.key_slope * max(q - 1.0, 0.0))


def batch_sizes(slots: int, widest: int = 9) -> tuple[int, ...]:
    """Totals worth measuring for `slots` in flight: small trees of one image and whole
    batches of trees up to `widest` tokens per slot (wider ones are extrapolated linearly: a
    forward that wide is past the point where drafting pays on any device this runs on, and
    measuring it made a 64-slot start-up take minutes on a CPU)."""
    per_slot = (1, 2, 3, 5, widest)
    sizes = set(SIZES) | {slots * s for s in per_slot}
    return tuple(sorted(n for n in sizes if n <= slots * widest or n <= max(SIZES)))


def _split(total: int, slots: int) -> tuple[int, int]:
    b = max(1, min(slots, total))
    return b, math.ceil(total / b)


def _prefilled(cache, prefix: int):
    """`cache` with its first `prefix` entries of every row committed, as a prefill would leave
    them. The entries are written (a constant, so every page is real memory) but not computed:
    a forward's time depends on how many keys it attends to, not on their values, and running
    the prefill for every measured size was most of a 64-slot start-up."""
    cache.k[:, :, :, :prefix].fill_(0.01)
    cache.v[:, :, :, :prefix].fill_(0.01)
    cache.set_lengths(np.full(cache.rows, prefix, dtype=np.int64))
    return cache


def monotone(table: dict[int, float]) -> dict[int, float]:
    """Each size's ms at most any wider size's: a forward (or draft level) carrying more tokens
    on as many rows never costs less, and other load only ever adds time, so of two readings that
    disagree the lower one holds. One slowed reading made a B 4 table read 49.4 ms for a plain
    step's 4 tokens and 40.8 for 8, and both cost planners then sized 1-node trees all run (the
    stand-in, twenty-second session)."""
    out, low = {}, float("inf")
    for n in sorted(table, reverse=True):
        low = out[n] = min(table[n], low)
    return dict(sorted(out.items()))


def _fastest_ms(fn, timer: Timer, repeats: int, warmup: int) -> float:
    """The fastest of `repeats` timed calls: other load on a shared machine only ever adds
    time, so the minimum is the steadiest estimate of the call's own cost. On a CPU the timer
    reads this process's CPU time, the clock the rounds are judged by (the planners' `cpu`):
    wall time there holds whatever else the machine ran meanwhile."""
    times = []
    for i in range(warmup + repeats):
        t0 = timer.now()
        fn()
        t1 = timer.now()
        if i >= warmup:
            times.append(t1 - t0)
    return min(times)


@torch.inference_mode()
def measure_target_cost(
    target: Target,
    rows: int = 2,
    sizes: tuple[int, ...] = SIZES,
    *,
    prefix_len: int,
    repeats: int = 7,
    warmup: int = 2,
    slots: int = 1,
) -> CostTable:
    """Time of a target forward carrying each total in `sizes`, split over up to `slots`
    slots (rows: 2 per slot with classifier-free guidance, else 1) on a cached prefix of
    `prefix_len` entries (`typical_prefix`: a typical mid-image state). Any family's target: ids
    up to its vocabulary size."""
    dev = next(target.parameters()).device
    prefix = prefix_len
    vocab_size = target.vocab.vocab_size
    max_pos = max_position(target)
    timer = Timer(dev, cpu=True)
    causal = lambda n: torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # noqa: E731
    out: dict[int, float] = {}
    for total in sizes:
        b, s = _split(total, slots)
        r = rows * b
        cache = _prefilled(target.new_cache(r, prefix + s), prefix)
        toks = torch.randint(0, vocab_size, (r, prefix + s), device=dev)
        pos = prefix + torch.arange(s, device=dev)
        pos = pos if max_pos is None else pos.clamp(max=max_pos)

        def step():
            target(pos, cache.attn_mask(causal(s)), cache, tokens=toks[:, prefix:])
            cache.truncate(prefix)

        out[total] = _fastest_ms(step, timer, repeats, warmup)
    return CostTable(monotone(out))


WIDE = 5  # new tokens per row of the wider forward `key_costs` times (a tree of 4 nodes a slot)


@torch.inference_mode()
def key_cost(target: Target, rows: int, slots: int, prefix_len: int, longer: int, repeats: int = 3,
             warmup: int = 1, width: int = 1) -> float:
    """Milliseconds a forward of `width` new tokens per slot over `slots` slots (a plain step:
    1) pays per cached key per cache row: the forward timed on a prefix of `prefix_len` and of
    `longer` entries (fastest of `repeats` each); the difference over the keys added (never below
    0). Attention reads every row up to the longest row's length, so rows at different lengths cost
    this much per key they lag the longest."""
    if longer <= prefix_len:
        return 0.0
    n = slots * width
    t = [measure_target_cost(target, rows, (n,), prefix_len=p, repeats=repeats, warmup=warmup,
                             slots=slots).ms[n] for p in (prefix_len, longer)]
    return max(0.0, (t[1] - t[0]) / (rows * slots * (longer - prefix_len)))


def key_costs(target: Target, rows: int, slots: int, prefix_len: int, longer: int) -> tuple[float, float]:
    """(key_ms, key_slope) of `CostTable`: a plain step's ms per cached key per row, and its growth per
    extra new token per row, from a forward of WIDE tokens per slot."""
    one = key_cost(target, rows, slots, prefix_len, longer)
    if one <= 0.0:
        return 0.0, 0.0
    wide = key_cost(target, rows, slots, prefix_len, longer, width=WIDE)
    return one, max(wide / one - 1.0, 0.0) / (WIDE - 1)


@torch.inference_mode()
def measure_draft_cost(drafter: Drafter, head, cfg_scale: float, rows: int, sizes: tuple[int, ...], slots: int = 1,
                       prefix_len: int = 128, repeats: int = 5, warmup: int = 1, *,
                       vocab_size: int) -> dict[int, float]:
    """Milliseconds of one draft level carrying each total of frontier tokens in `sizes`
    (split over up to `slots` slots): a drafter forward under a mask on a cached prefix, the
    target's head, CFG mixing and the top-k of every node, as `round/draft.py`'s `BatchDrafter` runs it. Token ids
    are drawn below `vocab_size` (the target's)."""
    from adt_core.round.sampling import cfg_mix

    w = drafter.fc.weight
    dim = w.shape[0]
    timer = Timer(w.device, cpu=True)
    mp = max_position(drafter)
    prefix = max(1, min(prefix_len, mp - 1)) if mp is not None else prefix_len
    out: dict[int, float] = {}
    for total in sizes:
        b, f = _split(total, slots)
        r = rows * b
        cache = _prefilled(drafter.new_cache(r, prefix + f), prefix)
        hid = torch.randn(r, prefix + f, dim, device=w.device, dtype=w.dtype)
        tok = torch.randint(0, vocab_size, (r, prefix + f), device=w.device)
        pos = torch.full((f,), prefix, dtype=torch.long, device=w.device)
        eye = torch.eye(f, dtype=torch.bool, device=w.device)

        def level():
            feats = drafter(tok[:, prefix:], hid[:, prefix:], pos, cache.attn_mask(eye), cache)
            cache.truncate(prefix)
            mixed = cfg_mix(head(feats), cfg_scale) if rows == 2 else head(feats)
            torch.topk(mixed.log_softmax(-1), min(10, mixed.shape[-1]), dim=-1)

        out[total] = _fastest_ms(level, timer, repeats, warmup)
    return monotone(out)


def measure_draft_level(drafter: Drafter, head, cfg_scale: float, rows: int, width: int = 10, repeats: int = 5, *,
                        vocab_size: int) -> float:
    """Milliseconds of one draft level of `width` frontier nodes for one slot."""
    return measure_draft_cost(drafter, head, cfg_scale, rows, (width,), repeats=repeats, vocab_size=vocab_size)[width]


def typical_prefix(prompter: Prompter) -> int:
    """Cached entries of a typical mid-image state: the prompter's typical prompt row plus half the image."""
    return int(prompter.typical_prompt) + prompter.layout.length // 2
