"""The whole-batch round: structure (operator counts, host reads) and its pure batched helpers.

Speed itself lives in `python -m jobs.bench --throughput`; here only what can be counted.
"""

import collections

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adt_core import AdaptiveConfig, DecodeConfig, Generator, TreeConfig, random_bundle
from adt_core.calibrate import CostTable
from adt_core.round.state import CandidateBatch
from adt_core.round.tree import ancestor_mask_batch, rerank_batch
from adt_core.round.verify import follow_batch, follow_targets

FLAT = CostTable({1: 1.0, 4096: 1.0}, draft={1: 0.01, 4096: 0.01})  # drafting always pays


class OpCount(TorchDispatchMode):
    """Counts the torch operators dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def decoder(bundle, method, slots, plain=False, **kw):
    g = Generator(bundle, DecodeConfig(method=method, batch_size=slots, temperature=1.0, top_k=20, cfg_scale=3.0,
                                       **kw))
    g.use_costs(FLAT)
    dec = g.decoder(slots)
    if plain:
        dec.planner.plan = lambda s: None  # the budget's plain round
    elif hasattr(dec.planner, "guard"):
        dec.planner.guard.worth_drafting = lambda a: True  # the budget drafts every round
    elif hasattr(dec.planner, "base"):  # jacobi's budget: a plain step's ms as if measured (its model drafts)
        dec.planner.base = dec.planner._base()
    items = [(i, f"prompt {i}", i) for i in range(slots)]
    rows = g.prompter.rows([p for _, p, _ in items], g.cfg_rows == 2)
    with torch.inference_mode():
        dec.admit(items, rows)
        dec.step()  # past first-round effects
    return dec


def test_a_non_drafting_round_costs_the_operators_of_an_ar_step():
    bundle = random_bundle(seed=1, vocab=64, grid=(4, 4))
    counts = {}
    for method, plain in (("ar", False), ("adt", True)):
        dec = decoder(bundle, method, 8, plain=plain)
        with torch.inference_mode(), OpCount() as c:
            dec.step()
        counts[method] = c.n
    assert counts["adt"] <= 1.05 * counts["ar"], counts


class HostReads:
    """Counts reads of device values on the host (each one waits for a GPU)."""

    # numpy() needs a CPU tensor, so on a GPU every read passes through one of these first
    NAMES = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, self._wrap(n, f))
        return self

    def _wrap(self, name, f):
        def counted(t, *a, **k):
            self.calls[name] += 1
            return f(t, *a, **k)
        return counted

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.mark.parametrize("method,kw", [("adt", {}), ("jacobi", {}),
                                       ("eagle2", dict(tree=TreeConfig(depth=3, top_k=3, budget=6))),
                                       ("static", dict(tree=TreeConfig(depth=3)))])
def test_one_host_read_per_round_whatever_the_slots(method, kw):
    bundle = random_bundle(seed=2, vocab=32, grid=(6, 6))
    reads = {}
    for slots in (2, 6):
        dec = decoder(bundle, method, slots, **kw)
        with torch.inference_mode(), HostReads() as spec:
            dec.step()
        plain = decoder(bundle, method, slots, plain=True, **kw)
        with torch.inference_mode(), HostReads() as step:
            plain.step()
        reads[slots] = (spec.total, step.total)
    assert reads[2] == reads[6], reads
    assert reads[2][0] == 1 and reads[2][1] == 0, reads  # one read per drafted round, none in a plain step


def random_pool(gen, c, levels, width):
    """A pool shaped like the drafter's: level 1 under the root, each next level under the best
    few of the last, scores decreasing along paths; some candidates invalid."""
    tokens, parents, depths, scores, valid = [], [], [], [], []
    last = None
    for d in range(1, levels + 1):
        if last is None:
            par = torch.full((c, width), -1)
            base = torch.zeros(c, width)
        else:
            pick = torch.randint(0, last[0].shape[1], (c, 2), generator=gen)
            par = (last[1] + pick).repeat_interleave(width, 1)
            base = last[0].gather(1, pick).repeat_interleave(width, 1)
        n = par.shape[1]
        off = sum(t.shape[1] for t in tokens)
        tokens.append(torch.stack([torch.randperm(50, generator=gen)[:n] for _ in range(c)]))
        parents.append(par)
        depths.append(torch.full((c, n), d))
        sc = base - torch.rand(c, n, generator=gen)
        scores.append(sc)
        valid.append(torch.rand(c, n, generator=gen) > 0.2 if d > 1 else torch.ones(c, n, dtype=torch.bool))
        last = (sc, torch.full((c, 1), off))
    pool = CandidateBatch(*(torch.cat(x, 1) for x in (tokens, parents, depths, scores, valid)))
    # a child of an invalid node is invalid
    for _ in range(levels):
        ok = torch.where(pool.parents >= 0, pool.valid.gather(1, pool.parents.clamp(min=0)), True)
        pool.valid &= ok
    return pool


def test_rerank_batch_keeps_each_slots_best_as_a_tree_and_follow_batch_walks_it():
    gen = torch.Generator().manual_seed(0)
    c, levels = 5, 4
    pool = random_pool(gen, c, levels, 3)
    budget = torch.tensor([1, 3, 6, 9, 12])
    roots = torch.arange(c) + 100
    batch = rerank_batch(pool, 12, budget, roots, levels)
    for b in range(c):
        n = batch.kept(b)
        best = torch.sort(pool.scores[b][pool.valid[b]], descending=True).values[: int(budget[b])]
        assert n == 1 + best.numel() and batch.valid[b, :n].all() and not batch.valid[b, n:].any(), b
        assert torch.equal(torch.sort(batch.scores[b, 1:n], descending=True).values, best), b  # the best kept
        par, dep = batch.parents[b, :n], batch.depths[b, :n]
        assert int(batch.tokens[b, 0]) == int(roots[b]) and (par[1:] < torch.arange(1, n)).all(), b  # parents first
        assert torch.equal(dep[1:], dep[par[1:]] + 1), b  # closed under ancestors, one level apart
        assert (dep[1:].diff() >= 0).all(), b  # breadth-first
        assert torch.equal(batch.mask[b, :n, :n], ancestor_mask_batch(par[None], levels)[0]), b
        # targets that follow a random path: the batched walk equals the slot-by-slot walk
        targets = torch.randint(0, 50, (batch.size,), generator=gen)
        for node in range(1, n):  # make the path through the first child of each node likely
            if torch.rand(1, generator=gen) < 0.7:
                targets[int(par[node])] = int(batch.tokens[b, node])
        res = follow_targets(batch, b, targets[:n].tolist())
        full = torch.zeros(c, batch.size, dtype=torch.long)
        full[b] = targets
        ver = follow_batch(batch, full, levels)
        a = int(ver.accepted[b])
        assert a == res.num_accepted
        assert ver.path[b, : a + 1].tolist() == [0] + res.accepted
        assert ver.new[b, : a + 1].tolist() == batch.tokens[b, res.accepted].tolist() + [res.bonus]


def test_static_tree_levels_follow_the_paths():
    from adt_core.round.draft import StaticLevels

    paths = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    lv = StaticLevels.build(paths, 3, "cpu")
    assert lv.levels == 3
    assert lv.ranks[0].tolist() == [[True, True]]  # the root keeps ranks 0 and 1
    assert lv.front[0].tolist() == [0, 1]  # both expand
    assert lv.ranks[1].tolist() == [[True, True], [True, False]]
    assert lv.front[1].tolist() == [0]  # only (0, 0) expands into level 3
    assert lv.ranks[2].tolist() == [[True]]
