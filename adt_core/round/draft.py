"""The drafter side of speculative decoding: whole-batch tensor work over every slot.

An EAGLE-style `Drafter` reads pairs (token at position p, target hidden state at p - 1) and
keeps its own ragged KV cache (slot b: rows b and C + b with CFG). `PairRing` holds the last
`RING` committed pairs of every slot; plain AR steps and verified rounds push into it (one
indexed store each). A speculative round then runs (`BatchDrafter.propose`):

1. catch-up (level 1): ONE drafter forward over every slot's pairs not yet fed (at most RING:
   after a long run of plain steps the older pairs stay out, so a skip costs one short feed);
   its output at each slot's last pair (the root) scores the root's children;
2. levels 2 .. D: ONE drafter forward per level over every slot's frontier (K nodes, the best
   of the last level by path score; a static tree's fixed nodes), under tree masks;
3. the tree nodes leave the drafter's cache; the candidates go to reranking (tree.rerank_batch).

Shapes are fixed by the round's plan (levels D, width K): a slot that may use fewer levels or
children than the batch has its extra candidates marked invalid, never a per-slot branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from adt_core.config import SamplingConfig
from adt_core.families.contract import Drafter, max_position
from adt_core.kv_cache import KVCache
from adt_core.round.sampling import cfg_mix, warp
from adt_core.round.state import CandidateBatch, RoundPlan, Slots
from adt_core.round.tree import static_children

SCORE_FLOOR = -1e4  # log-score floor: a child of a removed (-inf) token still scores below its parent
RING = 16  # committed pairs kept per slot for the drafter's catch-up


@dataclass(frozen=True)
class DraftScorer:
    """How a level's children are picked and scored from the drafter's CFG-mixed logits.

    Plain (greedy, or the rejection sampler): children = top-k of log q, score = log q.
    Coupled (`coupled` set): children = top-k of (warped q logits + the level's Gumbel row),
    the same noise the target's perturbed argmax uses at that position; the score is the
    log-softmax of those perturbed logits (`perturbed`: the probability that the target's
    perturbed argmax lands on the child if the two models' log-probs differ by i.i.d. Gumbel
    errors) or the warped log q (`logq`, EAGLE-2's path confidence).
    """

    coupled: SamplingConfig | None = None
    perturbed: bool = True

    def __call__(self, mixed: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """mixed (..., F, V) draft logits, noise (..., 1, V) or None -> (select key, score), each (..., F, V)."""
        if self.coupled is None or noise is None:
            logq = mixed.float().log_softmax(-1)
            return logq, logq
        warped = warp(mixed, self.coupled)  # removed tokens -inf
        pert = warped + noise.to(warped.dtype)
        score = (pert if self.perturbed else warped).log_softmax(-1).clamp(min=SCORE_FLOOR)
        return pert, score


class PairRing:
    """The last RING (hidden, token) pairs of every slot; pair i sits in column i % RING
    (column RING is a write sink for padding). `fed[b]`: pairs 0 .. fed[b] - 1 of slot b are in
    the drafter's cache or were skipped for good."""

    def __init__(self, slots: int, cfg_rows: int, dim: int, device, dtype) -> None:
        self.slots, self.cfg_rows = slots, cfg_rows
        self.h = torch.zeros(slots * cfg_rows, RING + 1, dim, device=device, dtype=dtype)  # (R, RING + 1, dim)
        self.t = torch.zeros(slots, RING + 1, dtype=torch.long, device=device)  # (C, RING + 1)
        self.fed = np.zeros(slots, np.int64)
        self._slot_idx = torch.arange(slots, device=device)
        self._row_idx = torch.arange(slots * cfg_rows, device=device)
        self._pending: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]] = []  # plain steps' pairs (`push_one`)

    def narrow(self, order: np.ndarray, rows: np.ndarray) -> None:
        """Keep slots `order` (n,), cache rows `rows` (n x cfg rows), as 0 .. n - 1 (BatchDecoder.narrow)."""
        self._flush()
        dev = self.t.device
        self.h = self.h.index_select(0, torch.from_numpy(rows).to(dev))
        self.t = self.t.index_select(0, torch.from_numpy(order).to(dev))
        self.fed, self.slots = self.fed[order], len(order)
        self._slot_idx = torch.arange(self.slots, device=dev)
        self._row_idx = torch.arange(self.slots * self.cfg_rows, device=dev)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(C, ...) -> (R, ...): the slot's value for each of its cfg rows."""
        return x if self.cfg_rows == 1 else torch.cat([x] * self.cfg_rows)

    def push(self, first: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Pairs first[b] + j (j < counts[b]): hidden (R, P, dim) before each token, tokens (C, P)."""
        self._flush()
        j = torch.arange(tokens.shape[1], device=tokens.device)
        col = torch.where(j < counts[:, None], (first[:, None] + j) % RING, RING)  # (C, P)
        self.t.scatter_(1, col, tokens)
        rcol = self.rows(col)  # (R, P)
        self.h[torch.arange(self.h.shape[0], device=col.device)[:, None], rcol] = hidden.to(self.h.dtype)

    def push_one(self, index: np.ndarray, hidden: torch.Tensor, tokens: torch.Tensor, active: np.ndarray) -> None:
        """One pair per slot (a plain step): pair index[b] (host (C,), its own copy) = (hidden (R,
        dim), tokens[b]) where active[b]. Kept as given until the ring is next read or RING of them
        wait, then stored in one scatter: each store's few indexed writes cost ~0.1 ms, 1.2% of a
        plain step at emoji16 B 4 on a CPU, paid on every plain step of a batch that may draft soon."""
        self._pending.append((np.where(active, index % RING, RING), hidden, tokens))
        if len(self._pending) >= RING:
            self._flush()

    def _flush(self) -> None:
        """Store the plain steps' pairs (`push_one`) in order: a slot's index grows by one per step it
        takes, so within RING steps no two of its pairs share a column (the sink RING takes the rest)."""
        if not self._pending:
            return
        cols, hidden, tokens = zip(*self._pending)
        self._pending = []
        col = torch.from_numpy(np.stack(cols, 1)).to(self.t.device)  # (C, S)
        self.t[self._slot_idx[:, None], col] = torch.stack(tokens, 1)
        self.h[self._row_idx[:, None], self.rows(col)] = torch.stack(hidden, 1).to(self.h.dtype)  # (R, S, dim)

    def skip(self, slots: np.ndarray, count: np.ndarray) -> None:
        """Pairs of `slots` (bool (C,)) below `count` (C,) will never be fed (a run of plain steps
        the planner will not draft after): no store at all, the next catch-up starts after them."""
        self.fed = np.where(slots, count, self.fed)

    def window(self, count: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pairs to feed: first index (C,) and how many (C,) (0 for free slots)."""
        lo = np.maximum(self.fed, count - RING)
        return lo, np.where(active, count - lo, 0)

    def gather(self, lo: torch.Tensor, n: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs lo[b] .. lo[b] + n[b] - 1, left-aligned and padded to `width`: hidden (R, width,
        dim), tokens (C, width)."""
        self._flush()
        j = torch.arange(width, device=lo.device)
        col = torch.where(j < n[:, None], (lo[:, None] + j) % RING, RING)  # (C, width)
        rcol = self.rows(col)
        hid = self.h.gather(1, rcol[..., None].expand(-1, -1, self.h.shape[2]))
        return hid, self.t.gather(1, col)


@dataclass(frozen=True)
class StaticLevels:
    """A static tree as fixed index tensors per level: level 1 takes ranks `ranks[0]` at the root;
    level d >= 2 expands entries `front[d-2]` of level d - 1's candidates into ranks `ranks[d-1]`."""

    front: tuple[torch.Tensor, ...]  # per level >= 2: (F_d,) long, indices into the previous level's block
    ranks: tuple[torch.Tensor, ...]  # per level: (F_d, Kc_d) bool, child ranks kept below each frontier node

    @classmethod
    def build(cls, paths: tuple[tuple[int, ...], ...], depth: int, device) -> "StaticLevels":
        kids = static_children(tuple(p for p in paths if len(p) <= depth))
        fronts, ranks, level = [], [], [()]  # level: the rank paths of the current block's entries
        for d in range(1, depth + 1):
            parents = [i for i, p in enumerate(level) if p in kids] if d > 1 else [0]
            if not parents:
                break
            paths_of = [level[i] for i in parents] if d > 1 else [()]
            kc = max(max(kids[p]) for p in paths_of) + 1
            mask = torch.zeros(len(paths_of), kc, dtype=torch.bool)
            for f, p in enumerate(paths_of):
                mask[f, kids[p]] = True
            if d > 1:
                fronts.append(torch.tensor(parents, dtype=torch.long, device=device))
            ranks.append(mask.to(device))
            level = [p + (r,) for p in paths_of for r in range(kc)]
        return cls(tuple(fronts), tuple(ranks))

    @property
    def levels(self) -> int:
        return len(self.ranks)


class BatchDrafter:
    def __init__(self, drafter: Drafter, head: Callable, cfg_scale: float, slots: int, cfg_rows: int,
                 cache: KVCache, scorer: DraftScorer, seq_pos: Callable[[torch.Tensor], torch.Tensor],
                 ids: Callable[[torch.Tensor], torch.Tensor] = lambda codes: codes) -> None:
        """cache: the drafter's, empty, slots x cfg_rows rows (`drafter.new_cache`); seq_pos: image
        indices (C, S) -> sequence positions (R, S) per cache row; ids: codes -> the ids the drafter
        embeds (the family's ImageVocab.to_id)."""
        self.drafter, self.head, self.cfg_scale, self.scorer = drafter, head, cfg_scale, scorer
        self.slots, self.cfg_rows, self.seq_pos, self.ids = slots, cfg_rows, seq_pos, ids
        self.cache: KVCache = cache
        w = drafter.fc.weight
        self.ring = PairRing(slots, cfg_rows, w.shape[0], w.device, w.dtype)
        self.max_pos = max_position(drafter)  # a position table bounds the drafter's positions
        self.forwards = 0  # drafter forward passes so far

    @property
    def device(self) -> torch.device:
        return self.cache.k.device

    def _host(self, x: np.ndarray) -> np.ndarray:
        """(C,) -> (R,) host values per cache row."""
        return np.concatenate([x] * self.cfg_rows)

    def _pos(self, index: torch.Tensor) -> torch.Tensor:
        """Image indices (C, S) -> drafter positions (R, S)."""
        pos = self.seq_pos(index)
        return pos if self.max_pos is None else pos.clamp(max=self.max_pos)

    # ---- slots --------------------------------------------------------------------------
    def narrow(self, order: np.ndarray) -> None:
        """Keep slots `order` (n,) as slots 0 .. n - 1 (BatchDecoder.narrow)."""
        order = np.asarray(order, dtype=np.int64)
        rows = np.concatenate([order + c * self.slots for c in range(self.cfg_rows)])
        self.cache.narrow(rows)
        self.ring.narrow(order, rows)
        self.slots = len(order)

    def reset(self, slots: np.ndarray) -> None:
        """Slots (bool (C,)) start empty: no cached pairs, nothing fed."""
        self.ring.fed[slots] = 0
        host = self.cache.host.copy()
        host[self._host(slots)] = 0
        self.cache.set_lengths(host)

    def caption_pairs(self, slots: np.ndarray, hidden: torch.Tensor) -> None:
        """LANTERN-style drafters read (code 0, h_j) at position j + 1 for every caption position
        j but the last, before the first image pair. slots: (n,) slot indices; hidden (cfg, n, T, dim)."""
        r, n, t = hidden.shape[0], hidden.shape[1], hidden.shape[2]
        dev = self.device
        tmp = self.drafter.new_cache(r * n, t)
        causal = torch.ones(t - 1, t - 1, dtype=torch.bool, device=dev).tril()
        tok = torch.zeros(r * n, t - 1, dtype=torch.long, device=dev)
        self.drafter(tok, hidden[:, :, : t - 1].reshape(r * n, t - 1, -1), torch.arange(1, t, device=dev),
                     tmp.attn_mask(causal), tmp)
        self.forwards += 1
        rows = torch.cat([torch.as_tensor(slots, device=dev) + c * self.slots for c in range(r)])
        self.cache.load_rows(rows, tmp)

    def prompt_pairs(self, slots: np.ndarray, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     lengths: np.ndarray) -> None:
        """A token family's prompt into the drafter's cache before the first image pair: pair j =
        (prompt token j + 1, target hidden at entry j) at that token's position, for j < length - 1
        of each row. slots: (n,) slot indices; tokens, positions (R_n, L) (cond rows, then uncond);
        hidden (R_n, L, dim); lengths (R_n,) prompt entries per row (right padding past them)."""
        rn, n = tokens.shape[0], tokens.shape[1] - 1
        if n < 1:
            return
        dev = self.device
        tmp = self.drafter.new_cache(rn, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # right padding: past each row's length
        self.drafter(tokens[:, 1:], hidden[:, :n], positions[:, 1:], tmp.attn_mask(causal), tmp)
        self.forwards += 1
        tmp.set_lengths(np.asarray(lengths, dtype=np.int64) - 1)  # pairs each row keeps
        r = rn // len(slots)
        rows = torch.cat([torch.as_tensor(slots, device=dev) + c * self.slots for c in range(r)])
        self.cache.load_rows(rows, tmp)

    # ---- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, plan: RoundPlan, slots: Slots, noise: torch.Tensor | None,
                static: StaticLevels | None = None) -> CandidateBatch:
        """Every slot's candidates for this round. noise: (C, D + 1, V) coupled rows of image
        indices n .. n + D, or None."""
        dev = self.device
        depth = torch.from_numpy(plan.depth).to(dev)  # (C,)
        widths = torch.from_numpy(plan.widths).to(dev)  # (C,)
        root_feat = self._catch_up(slots)  # (R, dim)
        # tree nodes go to one offset in every row (the longest committed row): plain slice writes;
        # a row's keys between its own length and that offset are masked
        start = self.cache.host.copy()
        top = int(start.max())
        committed = (torch.arange(top, device=dev) < torch.from_numpy(start).to(dev)[:, None])[:, None, None]
        self.cache.set_lengths(np.full_like(start, top))
        fmask = torch.arange(plan.width, device=dev) < widths[:, None]  # (C, K): a slot expands its own k best
        row = lambda lv: None if noise is None else noise[:, lv : lv + 1]  # noqa: E731  (C, 1, V)
        sel, score = self._score(root_feat[:, None], row(0))  # (C, 1, V)
        ranks = static.ranks[0] if static is not None else None
        block = _children(sel, score, torch.zeros(sel.shape[0], 1, device=dev), torch.full_like(depth[:, None], -1),
                          depth[:, None] >= 1, plan.width, widths, ranks, 1)
        pool = [block]
        feats, anc, kc = root_feat[:, None], None, block.tokens.shape[1]  # fed parents' features (R, F, dim)
        levels = plan.levels if static is None else min(plan.levels, static.levels)
        for d in range(2, levels + 1):
            fi = self._frontier(block, plan.width, static, d)  # (C, F) indices into the block
            fvalid = block.valid.gather(1, fi) if static is not None else block.valid.gather(1, fi) & fmask[:, : fi.shape[1]]
            parent_slot = fi // kc  # (C, F): which fed node of the last level each hangs under
            pf = feats.gather(1, self.ring.rows(parent_slot)[..., None].expand(-1, -1, feats.shape[2]))
            anc = _fed_ancestors(anc, parent_slot)  # (C, F, fed so far)
            f = fi.shape[1]
            mask = torch.cat([committed.expand(-1, -1, f, -1), self.ring.rows(anc)[:, None]], -1)  # (R, 1, F, keys)
            lv_pos = self._pos(slots.count[:, None] + (d - 2))  # (R, 1): image index of the fed nodes
            feats = self.drafter(self.ids(self.ring.rows(block.tokens.gather(1, fi))), pf, lv_pos, mask, self.cache)
            self.forwards += 1
            sel, score = self._score(feats, row(d - 1))  # (C, F, V)
            offset = sum(b.tokens.shape[1] for b in pool[:-1])
            ranks = static.ranks[d - 1] if static is not None else None
            block = _children(sel, score, block.scores.gather(1, fi), offset + fi, fvalid, plan.width, widths,
                              ranks, d)
            kc = block.tokens.shape[1] // f
            pool.append(block)
        self.cache.truncate(start)
        out = CandidateBatch(*(torch.cat([getattr(b, f) for b in pool], 1)
                               for f in ("tokens", "parents", "depths", "scores", "valid")))
        out.valid &= out.depths <= depth[:, None]  # a slot's levels past its own depth
        return out

    def _catch_up(self, slots: Slots) -> torch.Tensor:
        """Feed every active slot's unfed pairs in one forward; (R, dim) features at each root."""
        dev = self.device
        lo, n = self.ring.window(slots.host_count, slots.active)
        width = max(int(n.max()), 1)
        lo_t, n_t = torch.from_numpy(lo).to(dev), torch.from_numpy(n).to(dev)
        hid, tok = self.ring.gather(lo_t, n_t, width)  # (R, P, dim), (C, P)
        pos = self._pos(lo_t[:, None] + torch.arange(width, device=dev))  # (R, P)
        before = self.cache.host.copy()
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        feats = self.drafter(self.ids(self.ring.rows(tok)), hid, pos, self.cache.attn_mask(causal), self.cache)
        self.forwards += 1
        self.cache.set_lengths(before + self._host(n))
        self.ring.fed = np.where(slots.active, slots.host_count, self.ring.fed)
        last = self.ring.rows((n_t - 1).clamp(min=0))  # (R,)
        return feats[torch.arange(feats.shape[0], device=dev), last]

    def _score(self, features: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """features (R, F, dim) -> (select key, score), each (C, F, V)."""
        mixed = cfg_mix(self.head(features), self.cfg_scale)
        return self.scorer(mixed, noise)

    @staticmethod
    def _frontier(block: CandidateBatch, width: int, static: StaticLevels | None, d: int) -> torch.Tensor:
        """(C, F) block indices of the nodes expanded into level d: the K best by path score
        (invalid candidates last), or the static tree's fixed nodes."""
        if static is not None:
            return static.front[d - 2][None].expand(block.tokens.shape[0], -1)
        key = torch.where(block.valid, block.scores, float("-inf"))
        return torch.topk(key, min(width, key.shape[1]), dim=1).indices


def _children(sel: torch.Tensor, score: torch.Tensor, parent_score: torch.Tensor, parent: torch.Tensor,
              parent_valid: torch.Tensor, width: int, widths: torch.Tensor, ranks: torch.Tensor | None,
              d: int) -> CandidateBatch:
    """One level's candidates: the top children of each of F expanded nodes.

    sel/score (C, F, V) select key and score at the F nodes; parent_score (C, F) their path
    scores; parent (C, F) their pool indices (-1: the root); parent_valid (C, F). Dynamic trees
    keep ranks < widths[b]; a static level keeps `ranks` (F, Kc). Returns F * Kc candidates."""
    kc = ranks.shape[1] if ranks is not None else width
    kc = min(kc, sel.shape[-1])
    top = torch.topk(sel, kc, dim=-1)  # (C, F, Kc)
    r = torch.arange(kc, device=sel.device)
    keep = ranks[:, :kc][None] if ranks is not None else (r < widths[:, None, None])  # (C|1, F|1, Kc)
    valid = parent_valid[..., None] & keep
    c, f = parent.shape
    return CandidateBatch(
        tokens=top.indices.reshape(c, f * kc),
        parents=parent[..., None].expand(c, f, kc).reshape(c, f * kc),
        depths=torch.full((c, f * kc), d, dtype=torch.long, device=sel.device),
        scores=(parent_score[..., None] + score.gather(-1, top.indices)).reshape(c, f * kc),
        valid=valid.expand(c, f, kc).reshape(c, f * kc),
    )


def _fed_ancestors(anc: torch.Tensor | None, parent_slot: torch.Tensor) -> torch.Tensor:
    """Ancestor mask among the tree nodes fed to the drafter: the previous mask (C, F', W) or
    None (level 2: parents are the root), the new nodes' parents among the last fed level
    (C, F) -> (C, F, W' + F) with the new nodes last (each sees itself)."""
    c, f = parent_slot.shape
    eye = torch.eye(f, dtype=torch.bool, device=parent_slot.device).expand(c, f, f)
    if anc is None:
        return eye
    mine = anc.gather(1, parent_slot[..., None].expand(c, f, anc.shape[2]))  # (C, F, W): the parent's row
    return torch.cat([mine, eye], 2)
