"""Many images in flight: the slots, and one decoding round over all of them.

A `BatchDecoder` holds up to `capacity` images (slots). Slot b owns target-cache rows b and
capacity + b (cond, uncond) and the same drafter-cache rows. A round serves every active slot:

1. plan: each slot's draft request (its ADT controller's shape, EAGLE-2's or the static tree),
   or none (AR methods, the image's last token, or the cost budget's plain AR step);
2. draft: `TreeProposer.propose`: one drafter forward per level over every slot's frontier;
3. trees: per slot, rerank its candidates to its node budget (batch cost budget: a common m);
4. verify forward: ONE target forward over every slot's root + tree, padded to the widest
   (padding nodes attend only to themselves), per-row positions and ragged masks;
5. per slot: verify (greedy / coupled / rejection), commit accepted + bonus, keep root +
   accepted path in its cache rows (`KVCache.keep_rows`), queue its pairs for the drafter;
6. finished slots leave; the caller admits new prompts into free slots (continuous refill).

Time per image: each round's wall time is shared equally by the images that took part in it
(round time / images in the round); prefill time by the images admitted together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adt_core.adaptive import AdaptiveController, shape_budget
from adt_core.budget import BatchBudget
from adt_core.draft import DraftRequest, TreeProposer
from adt_core.sampling import cfg_mix
from adt_core.tree import DraftTree, rerank, static_children

if TYPE_CHECKING:
    from adt_core.results import StepStats


@dataclass
class Slot:
    """One image in flight."""

    index: int  # position in the caller's prompt list
    prompt: str
    seed: int
    seed_t: torch.Tensor  # (1,) long
    gen: torch.Generator  # the rejection sampler's randomness (unused by the coupled sampler)
    committed: list[int]  # image tokens so far
    ctrl: AdaptiveController | None
    stats: "StepStats"


@dataclass
class Finished:
    index: int
    prompt: str
    seed: int
    tokens: torch.Tensor  # (num_image_tokens,) long
    stats: "StepStats"


class BatchDecoder:
    def __init__(self, gen, capacity: int) -> None:
        self.g, self.capacity = gen, capacity
        b, c = gen.bundle, gen.config
        self.cfg_rows, self.n = gen.cfg_rows, gen.num_tokens
        self.t = b.target.config.cls_token_num
        max_nodes = gen.max_tree_nodes()
        depth_cap = c.adaptive.d_max if c.method == "adt" else c.tree.depth
        rows = self.cfg_rows * capacity
        self.cache = b.target.new_cache(rows, self.t + self.n + max_nodes + 1)
        self.proposer = None
        if c.method != "ar":
            self.proposer = TreeProposer(b.drafter, b.target.head, gen.sampling.cfg_scale, rows,
                                         self.t + self.n + (depth_cap + 1) * (max_nodes + 1), gen.scorer)
        self._static: dict[int, dict] = {}  # static trees by depth cap: path -> child ranks
        self.budget = BatchBudget(gen.cost_table(), c.adaptive) if c.method == "adt" and c.adaptive.budget == "cost" else None
        self.slots: list[Slot | None] = [None] * capacity
        self._rows = [torch.tensor([b + i * capacity for i in range(self.cfg_rows)], device=gen.device)
                      for b in range(capacity)]

    # ---- slots --------------------------------------------------------------------------
    def rows(self, b: int) -> torch.Tensor:
        """Slot b's cache rows (cfg,): b, then capacity + b with CFG."""
        return self._rows[b]

    def free(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is None]

    def active(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is not None]

    def admit(self, items: list[tuple[int, str, int]], captions: torch.Tensor, cmask: torch.Tensor) -> list[Finished]:
        """Prefill `items` (index, prompt, seed) with encoded captions (n, T, C), (n, T) into free
        slots; returns those already finished (one-token images)."""
        from adt_core.results import StepStats

        g = self.g
        t0 = g.timer.now()
        free = self.free()[: len(items)]
        n = len(items)
        tmp = g.bundle.target.new_cache(self.cfg_rows * n, self.t)
        logits, hidden = g.prefill(captions, cmask, tmp)  # (R_n, V), (R_n, T, dim)
        seeds = torch.tensor([s for _, _, s in items], dtype=torch.long, device=g.device)
        gens = [torch.Generator(device=g.device).manual_seed(int(s)) for _, _, s in items]
        first = g.sample(cfg_mix(logits, g.sampling.cfg_scale), gens, seeds, [0] * n).tolist()
        dst = torch.cat([torch.tensor(free, device=g.device) + i * self.capacity for i in range(self.cfg_rows)])
        self.cache.load_rows(dst, tmp)
        share = (g.timer.now() - t0) / n
        for j, (b, (index, prompt, seed)) in enumerate(zip(free, items)):
            ctrl = AdaptiveController(g.bundle.grid, g.config.adaptive) if g.config.method == "adt" else None
            stats = StepStats(lossy=g.config.lantern is not None, sampler=g.sampler, target_forwards=1,
                              total_ms=share, verify_ms=share, batch_size=self.capacity)
            self.slots[b] = Slot(index, prompt, int(seed), seeds[j : j + 1], gens[j], [first[j]], ctrl, stats)
            if self.proposer is not None:
                self.proposer.reset(b)
                h = hidden[torch.arange(j, self.cfg_rows * n, n, device=g.device)]  # (cfg, T, dim)
                if g.bundle.drafter.config.caption_pairs:  # LANTERN: (code 0, h_j) for every caption position
                    self.proposer.observe(b, h, [0] * (self.t - 1) + [first[j]], 1)
                else:
                    self.proposer.observe(b, h[:, -1:], [first[j]], self.t)
        return self._retire_done()

    def _retire_done(self) -> list[Finished]:
        out = []
        for b, s in enumerate(self.slots):
            if s is not None and len(s.committed) >= self.n:
                tokens = torch.zeros(self.g.bundle.target.config.num_image_tokens, dtype=torch.long)
                tokens[: self.n] = torch.tensor(s.committed[: self.n])
                out.append(Finished(s.index, s.prompt, s.seed, tokens, s.stats))
                self.slots[b] = None
                lengths = self.cache.lengths.clone()
                lengths[self.rows(b)] = 0
                self.cache.set_lengths(lengths)
                if self.proposer is not None:
                    self.proposer.reset(b)
        return out

    # ---- one round ----------------------------------------------------------------------
    def _requests(self, active: list[int]) -> dict[int, DraftRequest]:
        """Step 1: each drafting slot's request (none: a root-only round for that slot)."""
        g, c = self.g, self.g.config
        if self.proposer is None:
            return {}
        if self.budget is not None and not self.budget.worth_drafting(len(active)):
            return {}
        reqs = {}
        for b in active:
            s = self.slots[b]
            index = len(s.committed)
            max_depth = self.n - index - 1
            if max_depth <= 0:
                continue
            if c.method == "static":
                depth, width = min(c.tree.depth, max_depth), 0
            elif s.ctrl is not None:
                shape = s.ctrl.shape(index)
                depth, width = min(shape.depth, max_depth), shape.width
            else:
                depth, width = min(c.tree.depth, max_depth), c.tree.top_k
            static = self._static_shape(depth) if c.method == "static" else None
            noise = g.noise_rows(s.seed_t, index, depth + 1)
            reqs[b] = DraftRequest(s.committed[-1], self.t + index - 1, depth, width, static,
                                   None if noise is None else noise[:depth])
        return reqs

    def _static_shape(self, depth: int) -> dict[tuple[int, ...], list[int]]:
        """The static tree cut to `depth` levels, built once per depth."""
        if depth not in self._static:
            paths = self.g.config.tree.static_paths
            self._static[depth] = static_children(tuple(p for p in paths if len(p) <= depth))
        return self._static[depth]

    def _tree(self, b: int, pool, m: int | None) -> tuple[DraftTree, int]:
        """Step 3: rerank slot b's candidates to its node budget; returns the tree and its width."""
        c, s = self.g.config, self.slots[b]
        index = len(s.committed)
        root, root_pos = s.committed[-1], self.t + index - 1
        if pool is None or pool.tokens.numel() == 0:
            return DraftTree.root_only(root, root_pos, self.g.device), 0
        if m is not None:
            n = m
        elif c.method == "static":
            n = pool.tokens.numel()
        elif s.ctrl is not None:
            shape = s.ctrl.shape(index)
            n = shape_budget(shape.depth, shape.width, c.adaptive)
        else:
            n = c.tree.budget
        if n <= 0:
            return DraftTree.root_only(root, root_pos, self.g.device), 0
        width = 0 if c.method == "static" else (s.ctrl.shape(index).width if s.ctrl is not None else c.tree.top_k)
        return rerank(pool, n, root, root_pos), width

    def step(self) -> list[Finished]:
        """One round over every active slot; returns the images that finished."""
        g = self.g
        active = self.active()
        if not active:
            return []
        a = len(active)
        ta = g.timer.now()
        reqs = self._requests(active)
        pools, m = {}, None
        if reqs:
            gate = self.budget.level_gate(a) if self.budget is not None else None
            pools = self.proposer.propose(reqs, gate)
            if self.budget is not None:
                m = self.budget.choose([p.scores for p in pools.values()], g.timer.now() - ta)
        if not pools:
            done = self._ar_round(active, ta)
            if self.budget is not None:
                self.budget.observe_round(a, False, g.timer.now() - ta, a)
            return done
        trees = {b: self._tree(b, pools.get(b), m) for b in active}
        tb = g.timer.now()
        res = self._verify_round(active, trees)
        tc = g.timer.now()
        if self.budget is not None:
            self.budget.observe_round(a, True, tc - ta, sum(r.num_accepted + 1 for r in res.values()))
        width = max(t.size for t, _ in trees.values())
        for b in active:
            g.record(self.slots[b].stats, trees[b][0], res[b], len(self.slots[b].committed) - res[b].num_accepted - 1,
                     trees[b][1], (tb - ta) / a, (tc - tb) / a, slots=a, tokens=a * width,
                     drafted=b in reqs)
        return self._retire_done()

    def _ar_round(self, active: list[int], ta: float) -> list[Finished]:
        """A plain batched AR step for every active slot (no drafting this round): one target
        forward of each slot's root, one vectorised draw, each row's length + 1."""
        g, dev, cap = self.g, self.g.device, self.capacity
        slots = [self.slots[b] for b in active]
        idx = torch.tensor(active, device=dev)
        tok = torch.zeros(cap, 1, dtype=torch.long, device=dev)
        pos = torch.zeros(cap, 1, dtype=torch.long, device=dev)
        tok[idx, 0] = torch.tensor([s.committed[-1] for s in slots], device=dev)
        pos[idx, 0] = torch.tensor([self.t + len(s.committed) - 1 for s in slots], device=dev)
        rows = lambda x: torch.cat([x] * self.cfg_rows)  # noqa: E731  slots -> cache rows
        start = self.cache.lengths.clone()
        one = torch.ones(self.cache.rows, 1, 1, dtype=torch.bool, device=dev)
        logits, hidden = g.bundle.target(rows(pos), self.cache.attn_mask(one), self.cache, tokens=rows(tok))
        mixed = cfg_mix(logits[:, 0], g.sampling.cfg_scale)  # (cap, V)
        seeds = torch.cat([s.seed_t for s in slots])
        new = g.sample(mixed[idx], [s.gen for s in slots], seeds, [len(s.committed) for s in slots]).tolist()
        grow = torch.zeros(cap, dtype=torch.long, device=dev)
        grow[idx] = 1
        self.cache.set_lengths(start + rows(grow))
        share = (g.timer.now() - ta) / len(active)
        last = hidden[:, :1]  # (R, 1, dim): each row's state before its new token
        for b, s, y in zip(active, slots, new):
            index = len(s.committed)
            s.committed.append(int(y))
            if self.proposer is not None and len(s.committed) < self.n:
                self.proposer.observe(b, last[self._rows[b]], [int(y)], self.t + index)
            g.record(s.stats, None, None, index, 0, 0.0, share, slots=len(active), tokens=len(active), drafted=False)
        return self._retire_done()

    def _verify_round(self, active: list[int], trees: dict[int, tuple[DraftTree, int]]) -> dict:
        """Steps 4-5: one padded target forward over all trees, then verify and commit per slot."""
        g, dev, cap, r = self.g, self.g.device, self.capacity, self.cfg_rows
        s_max = max(t.size for t, _ in trees.values())
        tok = torch.zeros(cap, s_max, dtype=torch.long, device=dev)
        pos = torch.zeros(cap, s_max, dtype=torch.long, device=dev)
        mask = torch.eye(s_max, dtype=torch.bool, device=dev).repeat(cap, 1, 1)  # padding: itself only
        for b, (tree, _) in trees.items():
            n = tree.size
            tok[b, :n] = tree.tokens.to(dev)
            pos[b, :] = tree.root_position
            pos[b, :n] = tree.positions.to(dev)
            mask[b, :n, :n] = tree.ancestor_mask().to(dev)
        rows = lambda x: torch.cat([x] * r)  # noqa: E731  slots -> cache rows
        start = self.cache.lengths.clone()
        logits, hidden = g.bundle.target(rows(pos), self.cache.attn_mask(rows(mask)), self.cache, tokens=rows(tok))
        mixed = cfg_mix(logits, g.sampling.cfg_scale)  # (cap, S, V)
        res = g.verify_all({b: trees[b][0] for b in active}, mixed, {b: self.slots[b] for b in active})
        keep = torch.zeros(cap, s_max, dtype=torch.long, device=dev)
        count = torch.zeros(cap, dtype=torch.long, device=dev)
        for b in active:
            path = [0] + res[b].accepted
            keep[b, : len(path)] = torch.tensor(path, device=dev)
            count[b] = len(path)
        self.cache.keep_rows(start, rows(keep), rows(count))
        for b in active:
            s, tree, rv = self.slots[b], trees[b][0], res[b]
            index = len(s.committed)
            new = tree.tokens[rv.accepted].tolist() + [rv.bonus]
            s.committed += new
            if self.proposer is not None and len(s.committed) < self.n:
                kb = keep[b, : int(count[b])]
                self.proposer.observe(b, hidden[self.rows(b)][:, kb], new, self.t + index)
            if s.ctrl is not None:
                s.ctrl.observe(index, tree.depth, trees[b][1], rv.num_accepted)
        return res
