"""Many images in flight: the slots, and one decoding round over all of them.

A `BatchDecoder` holds up to C images (slots). Slot b owns target-cache rows b and C + b (cond,
uncond) and the same drafter-cache rows. Every round is whole-batch tensor work over all C slots
(free ones ride along as padding), with ONE host read per speculative round and none in a plain
step:

- plan (host): the method's `Planner` gives a `RoundPlan` or None (adt_core/round/plan.py);
- plain step (None, and every `ar` step): one target forward of each slot's root, one draw per
  slot, commit; the drafter's pairs go to its ring (one indexed store). The same code serves
  `ar` and a speculative method's non-drafting rounds, so such a round costs what `ar` pays;
- speculative round: draft (adt_core/round/draft.py: catch-up + one drafter forward per level), rerank
  to the plan's M nodes per slot (tree.rerank_batch), ONE target forward over every root + tree
  (per-row positions and ancestor masks), verify (verify.follow_batch; the rejection sampler and
  LANTERN's relaxed acceptance verify slot by slot), then the one read: accepted counts and what
  the planner learns. Commit: keep root + accepted path in each cache row, append the tokens.

Model families (adt_core/families/contract.py): a slot's rows are prefilled from the family's
PromptRows (each row its own length); image index i of cache row r sits at base[r] +
layout.offset(i); the models read ids (ImageVocab.to_id) and give logits over codes. Forced
end-of-line tokens (Lumina) ride in the forward that caches a row's last code
(adt_core/round/forced.py); trees never cross a row end.

Time per image: each round's wall time is shared equally by its images; prefill time by the
images admitted together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from adt_core.bundles.bundle import Bundle
from adt_core.calibrate import CostTable, Timer
from adt_core.config import DecodeConfig
from adt_core.families.contract import Layout
from adt_core.kv_cache import CacheStore
from adt_core.round.adaptive import AdaptiveGrid
from adt_core.round.draft import BatchDrafter, DraftScorer, StaticLevels
from adt_core.round.forced import ForcedEol
from adt_core.round.jacobi import jacobi_window, verify_sjd
from adt_core.round.neighbours import ImagePrior
from adt_core.round.log import RoundLog
from adt_core.round.plan import Planner
from adt_core.round.planners import planner_for
from adt_core.round.sampler import Sampler
from adt_core.round.sampling import cfg_mix
from adt_core.round.slot_table import Finished, SlotTable
from adt_core.round.state import CandidateBatch, RoundOutcome, RoundPlan, Slots, TreeBatch, Verified
from adt_core.round.tree import rerank_batch
from adt_core.round.verify import Relaxation, follow_batch, verify_coupled, verify_greedy, verify_stochastic

@dataclass(frozen=True)
class DecodeSetup:
    """What a BatchDecoder needs from its Generator, fixed for the Generator's life."""

    bundle: Bundle
    config: DecodeConfig
    sampler: Sampler
    scorer: DraftScorer
    cfg_rows: int  # 2 with classifier-free guidance, else 1
    n_tokens: int  # image tokens decoded per image
    device: torch.device
    timer: Timer
    costs: CostTable | None  # the cost budget's measured table (adt + cost), else None
    relax: Relaxation | None  # LANTERN's relaxed acceptance (lossy), else None
    planners: dict  # capacity -> the last decoder's planner: what it learned carries over
    prompter: object  # the family's Prompter (adt_core/families/contract.py): prompt rows, layout, vocabulary
    max_prompt: int  # the longest prompt row a slot may hold (cache entries before image index 0)
    prior: ImagePrior | None = None  # jacobi: what the images decoded so far say of the next token
    store: CacheStore = field(default_factory=CacheStore)  # the Generator's caches, kept between its decoders


class BatchDecoder(SlotTable):
    def __init__(self, setup: DecodeSetup, capacity: int) -> None:
        self.s, self.capacity = setup, capacity
        self.batch_size = capacity  # the batch its images were admitted to (their telemetry's); `narrow` keeps it
        b, c = setup.bundle, setup.config
        self.n, self.r = setup.n_tokens, setup.cfg_rows
        self.layout: Layout = setup.prompter.layout
        self.vocab = setup.prompter.vocab
        # id of each code the models read (id == code needs no op)
        self.ids = self.vocab.to_id if self.vocab.first_id else (lambda codes: codes)
        self.base = setup.max_prompt  # the longest prompt row
        span = int(self.layout.offset(self.n - 1)) + 1  # sequence entries of image indices 0 .. n - 1
        # each cache row's prompt length = sequence position of its image index 0 (per row: a
        # family's uncond row may be shorter than its cond row); set on admit
        self.row_base = np.zeros(self.r * capacity, np.int64)
        self.base_col = torch.zeros(self.r * capacity, 1, dtype=torch.long, device=setup.device)  # (R, 1)
        # forced end-of-line after every image row (Lumina): adt_core/round/forced.py
        self.forced = None
        if self.layout.eol is not None:
            self.forced = ForcedEol(torch.tensor(self.layout.eol, dtype=torch.long, device=setup.device),
                                    self.layout.grid_w, self.n, self.rows)
        self.scale = setup.sampler.sampling.cfg_scale
        adt = c.shaped
        self.grid = AdaptiveGrid(capacity, (self.layout.grid_h, self.layout.grid_w), c.adaptive) if adt else None
        self.planner: Planner = planner_for(c, self.n, self.grid, setup.costs, capacity)
        if capacity in setup.planners:
            self.planner.adopt(setup.planners[capacity])
        elif setup.planners:  # another capacity's: its measurements per slot count
            self.planner.share(setup.planners[min(setup.planners, key=lambda c: abs(c - capacity))])
        setup.planners[capacity] = self.planner
        extent = self.planner.extent(c)  # the one cache-size formula (memory.py plans by it too)
        self.cache = setup.store.take(b.target, self.r * capacity, extent.target_len(self.base + span))
        self.drafter = None
        self.jacobi = c.method == "jacobi"  # the draft source is the target's own window (adt_core/round/jacobi.py)
        if self.planner.drafts and self.jacobi:
            self.drafter = jacobi_window(c, setup, capacity, self.layout.grid_w)
        elif self.planner.drafts:
            cache = setup.store.take(b.drafter, self.r * capacity, extent.drafter_len(self.base + span))
            self.drafter = BatchDrafter(b.drafter, b.target.head, self.scale, capacity, self.r, cache, setup.scorer,
                                        self.seq_pos, self.ids)
        self.static = c.tree.static_paths if c.method == "static" else None
        self._static_levels: dict[int, StaticLevels] = {}
        self.slots = Slots.empty(capacity, self.n, setup.device)
        self.meta: list[tuple[int, str, int] | None] = [None] * capacity
        self.log = RoundLog(capacity, c.method != "ar", c.lantern is not None, setup.sampler.kind, c.needs_drafter)
        self.curve_len = c.adaptive.n_max + 1
        self.verify_slot = {"greedy": self._greedy_one, "coupled": self._coupled_one,
                            "rejection": self._sjd_one if self.jacobi else self._rejection_one}[setup.sampler.kind]

    def release(self) -> None:
        """The decoder is done: its caches go back to the Generator's store for the next one."""
        self.s.store.give(self.s.bundle.target, self.cache)
        if isinstance(self.drafter, BatchDrafter):
            self.s.store.give(self.s.bundle.drafter, self.drafter.cache)
        self.cache = self.drafter = None

    def seq_pos(self, index: torch.Tensor) -> torch.Tensor:
        """Image indices (C, S) of each slot -> their sequence positions (R, S) in each cache row:
        the row's prompt length plus the layout's offset of the index."""
        return self.layout.offset(self.rows(index)) + self.base_col

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(C, ...) -> (R, ...): each slot's value for its cond then uncond row."""
        return x if self.r == 1 else torch.cat([x] * self.r)

    def host_rows(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([x] * self.r)

    # ---- one round ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, held: bool = False) -> list[Finished]:
        """One round over every active slot; returns the images that finished. held: free slots
        wait for the rest of their wave (`admits_now`), so the planner's probes wait too."""
        if not self.slots.active.any():
            return []
        self.slots.held = held
        self.slots.room = self.cache.max_len - self.cache.length - 2  # the root (and a forced companion) first
        t0 = self.s.timer.mark()
        plan = self.planner.plan(self.slots)
        if plan is not None and self.forced is not None:
            plan = self.forced.within_row(plan, self.slots)
        if self.planner.reads_rows and self.planner.judged:  # the rows it starts from: how far apart (`budget.Ragged`)
            self.planner.ragged(*self.ragged_keys())
        if plan is None:
            a = self._plain_step(t0)
        else:
            out, a, draft_ms = self._spec_round(plan, t0)
        done = self._retire()
        # the planner learns what the whole round cost, its bookkeeping and retirements included
        # (drafted rounds log and retire more: left out, ~0.5 ms of a 7.5 ms round at B 1 on a CPU)
        ms = self.s.timer.now() - t0
        if plan is None:
            self.planner.observe_plain(a, ms)
        else:
            self.planner.observe(plan, out, a, ms, draft_ms)
        return done

    def _plain_step(self, t0: float) -> int:
        """A plain batched AR step: each slot's root through the target, one draw per slot.
        Returns the slots it stepped."""
        s, setup, dev = self.slots, self.s, self.s.device
        active = s.active.copy()
        position = s.host_count.copy()
        pos = self.seq_pos((s.count - 1)[:, None])  # (R, 1)
        start = self.cache.host.copy()
        eol = self.forced.roots(self.slots) if self.forced is not None else None
        tokens = self.ids(self.rows(s.roots()[:, None]))
        if eol is None:
            one = torch.ones(self.cache.rows, 1, 1, dtype=torch.bool, device=dev)
            logits, hidden = setup.bundle.target(pos, self.cache.attn_mask(one), self.cache, tokens=tokens)
        else:
            eol_t = torch.from_numpy(eol).to(dev)
            tokens, pos, causal = self.forced.with_companion(tokens, pos, None, eol_t)
            logits, hidden = setup.bundle.target(pos, self.cache.attn_mask(causal), self.cache, tokens=tokens)
            r_eol = self.rows(eol_t)
            logits, hidden = self.forced.root_entry(logits, r_eol), self.forced.root_entry(hidden, r_eol)
        new = setup.sampler.sample(cfg_mix(logits[:, 0], self.scale), s.keys, s.count, s.gens)  # (C,)
        grow = active.astype(np.int64)
        self.cache.set_lengths(start + self.host_rows(grow if eol is None else grow + eol))
        counts = torch.from_numpy(grow).to(dev)
        if self.jacobi or self.drafter is None:
            pass
        elif self.planner.feeds_drafter(int(active.sum())):
            self.drafter.ring.push_one(position, hidden[:, 0], new, active)
        else:
            self.drafter.ring.skip(active, position + 1)  # pairs up to this one: never fed
        s.write(new[:, None], counts, grow)
        ms = setup.timer.now() - t0
        self.log.add(active, position, 0.0, ms)
        return int(active.sum())

    def _spec_round(self, plan: RoundPlan, t0: float) -> tuple[RoundOutcome, int, float]:
        """A speculative round; returns what the planner learns from: the round's outcome, the
        slots in it and its draft ms."""
        s, setup, dev = self.slots, self.s, self.s.device
        active, position = s.active.copy(), s.host_count.copy()
        noise = setup.sampler.noise(s.keys, s.count, plan.levels + 1)  # (C, D + 1, V) or None
        pool = self.drafter.propose(plan, s, noise, self._static(plan.levels))
        t1 = setup.timer.mark()
        tree = rerank_batch(pool, plan.nodes, torch.from_numpy(plan.budget).to(dev), s.roots(), plan.levels)
        start = self.cache.host.copy()
        pos = self.seq_pos((s.count - 1)[:, None] + tree.depths)  # (R, 1 + M)
        eol = self.forced.roots(self.slots) if self.forced is not None else None
        tokens, tmask = self.ids(self.rows(tree.tokens)), tree.mask
        if eol is not None:
            eol_t = torch.from_numpy(eol).to(dev)
            tokens, pos, tmask = self.forced.with_companion(tokens, pos, tmask, eol_t)
        logits, hidden = setup.bundle.target(pos, self.cache.attn_mask(self.rows(tmask)), self.cache, tokens=tokens)
        if eol is not None:
            r_eol = self.rows(eol_t)
            logits, hidden = self.forced.root_entry(logits, r_eol), self.forced.root_entry(hidden, r_eol)
        mixed = cfg_mix(logits, self.scale)  # (C, 1 + M, V)
        active_t = torch.from_numpy(active).to(dev)
        ver = self._verify(tree, mixed, noise, plan.levels, active)
        counts = torch.where(active_t, ver.accepted + 1, 0)
        out = self._read(ver, tree, pool, active_t, plan.levels)  # the one host read
        grow = np.where(active, out.accepted + 1, 0)
        if eol is None:
            self.cache.keep_rows(start, self.rows(ver.path), self.host_rows(grow))
        else:  # entries: root, companion, nodes
            self.cache.keep_rows(start, self.rows(self.forced.cache_index(ver.path, eol_t)), self.host_rows(grow + eol))
        if self.jacobi:  # the unaccepted tail's predictions: the next round's drafts
            self.drafter.carry(tree, mixed, ver, noise, s.count, active_t, plan.levels)
        else:
            kept = hidden.gather(1, self.rows(ver.path)[..., None].expand(-1, -1, hidden.shape[2]))  # (R, D + 1, dim)
            self.drafter.ring.push(s.count, kept, ver.new, counts)
        s.write(ver.new, counts, grow)
        if self.grid is not None:
            self.grid.observe(position, np.where(active, out.depth, 0), plan.widths, out.accepted)
        t2 = setup.timer.now()
        self.log.add(active, position, t1 - t0, t2 - t1, out.depth, plan.widths, out.nodes, out.accepted,
                     plan.levels, int(active.sum()) * tree.size)
        return out, int(active.sum()), t1 - t0

    def _static(self, levels: int) -> StaticLevels | None:
        if self.static is None:
            return None
        if levels not in self._static_levels:
            self._static_levels[levels] = StaticLevels.build(self.static, levels, self.s.device)
        return self._static_levels[levels]

    def _read(self, ver: Verified, tree: TreeBatch, pool: CandidateBatch, active: torch.Tensor,
              levels: int) -> RoundOutcome:
        """Everything the host needs from this round, in one device -> host copy."""
        c = self.capacity
        live = tree.valid & (tree.depths > 0) & active[:, None]  # (C, 1 + M) drafted nodes of active slots
        depth = torch.where(tree.valid, tree.depths, 0).max(1).values
        parts = [ver.accepted.double(), depth.double(), live.sum(1).double()]
        if self.planner.reads_curves:  # what the cost budget learns acceptance from
            conf = torch.where(live, tree.scores.double().exp(), 0.0)
            level_conf = torch.zeros(levels + 1, dtype=torch.float64, device=conf.device)
            level_conf.scatter_add_(0, tree.depths.flatten(), conf.flatten())
            parts += [level_conf, self._curves(pool, active, levels).flatten()]
        flat = torch.cat(parts).cpu().numpy()
        i = np.cumsum([0, c, c, c, levels + 1])
        ints = lambda x: x.astype(np.int64)  # noqa: E731
        return RoundOutcome(ints(flat[i[0]:i[1]]), ints(flat[i[1]:i[2]]), ints(flat[i[2]:i[3]]), flat[i[3]:i[4]],
                            flat[i[4]:].reshape(-1, self.curve_len))

    def _curves(self, pool: CandidateBatch, active: torch.Tensor, levels: int) -> torch.Tensor:
        """(D, n_max + 1): row j - 1, column m = the summed path confidence of each active slot's
        m best candidates of depth <= j (the expected tokens of a tree of j levels and m nodes,
        EAGLE-2's expectation), summed over the slots."""
        m = min(self.curve_len - 1, pool.scores.shape[1])
        cap = torch.arange(1, levels + 1, device=pool.depths.device)[:, None, None]  # (D, 1, 1)
        ok = (pool.valid & active[:, None])[None] & (pool.depths[None] <= cap)  # (D, C, P)
        best = torch.topk(torch.where(ok, pool.scores.double()[None], float("-inf")), m, dim=2).values
        curve = best.exp().cumsum(2).sum(1)  # (D, m)
        zero = torch.zeros(levels, 1, dtype=torch.float64, device=curve.device)
        return torch.cat([zero, curve, curve[:, -1:].expand(levels, self.curve_len - 1 - m)], 1)

    # ---- verification ---------------------------------------------------------------------
    def _verify(self, tree: TreeBatch, mixed: torch.Tensor, noise: torch.Tensor | None, levels: int,
                active: np.ndarray) -> Verified:
        """Whole-batch for greedy and coupled; slot by slot for the rejection sampler and LANTERN."""
        if self.s.sampler.vectorised and self.s.relax is None:
            nz = None
            if noise is not None:  # each node's position row: nodes at one depth share it
                nz = noise.gather(1, tree.depths[..., None].expand(-1, -1, noise.shape[2]))
            return follow_batch(tree, self.s.sampler.targets(mixed, nz), levels)
        c, dev = self.capacity, self.s.device
        acc = torch.zeros(c, dtype=torch.long, device=dev)
        path = torch.zeros(c, levels + 1, dtype=torch.long, device=dev)
        new = torch.zeros(c, levels + 1, dtype=torch.long, device=dev)
        for b in np.flatnonzero(active):
            n = tree.kept(b)
            nz = None if noise is None else noise[b][tree.depths[b, :n]]
            res = self.verify_slot(tree, b, mixed[b, :n], self.slots.gens[b], nz)
            a = res.num_accepted
            acc[b] = a
            path[b, : a + 1] = torch.tensor([0] + res.accepted, device=dev)
            new[b, : a + 1] = torch.cat([tree.tokens[b, res.accepted], torch.tensor([res.bonus], device=dev)])
        return Verified(acc, path, new)

    # slot b's tree (its rows of the TreeBatch); mixed (n, V) and noise (n, V) at its n valid nodes
    def _greedy_one(self, tree: TreeBatch, b: int, mixed, gen, noise):
        return verify_greedy(tree, b, mixed, self.s.relax)

    def _coupled_one(self, tree: TreeBatch, b: int, mixed, gen, noise):
        return verify_coupled(tree, b, mixed, noise, self.s.sampler.sampling, self.s.relax)

    def _rejection_one(self, tree: TreeBatch, b: int, mixed, gen, noise):
        return verify_stochastic(tree, b, mixed, self.s.sampler.sampling, gen, self.s.relax)

    def _sjd_one(self, tree: TreeBatch, b: int, mixed, gen, noise):
        w, n, h = self.drafter, mixed.shape[0], tree.host()
        return verify_sjd(h.tokens[b][:n], h.depths[b][:n], mixed, self.s.sampler.sampling,
                          gen, w.chain_q[b], w.chain_has[b].tolist())
