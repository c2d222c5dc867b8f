"""The drafter side of speculative decoding, for many images (slots) at once.

`TreeProposer` drives an EAGLE-style `Drafter` with its own ragged KV cache: slot b owns rows
b (and slots + b with CFG) holding that image's committed (hidden, token) pairs. `observe`
queues the pairs of newly committed tokens per slot (pairs queue up over rounds that did not
draft: the drafter then catches up in one forward, on at most the last 2 x CATCHUP_PAIRS of
them); `propose` feeds every queued pair in ONE padded forward, expands all requested trees
level by level with ONE drafter forward per level over every slot's frontier (per-row
positions and tree masks), then forgets the tree nodes (each row keeps only committed pairs). It returns each slot's candidate pool; the caller picks
how many nodes to keep (`tree.rerank`).

Expansion shapes (per slot):
- dynamic (EAGLE-2 / ADT-Tree): level 1 = top-k children of the root; each next level expands
  the k best candidates of the previous level by path score into k children each.
- static: a fixed tree given as {path of child ranks: child ranks}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from adt_core.config import SamplingConfig
from adt_core.kv_cache import KVCache
from adt_core.models.drafter import Drafter
from adt_core.sampling import cfg_mix, warp
from adt_core.tree import CandidatePool, top_frontier

SCORE_FLOOR = -1e4  # log-score floor: a child of a removed (-inf) token still scores below its parent
# after many rounds without drafting a slot's queue keeps its last CATCHUP_PAIRS pairs (once it
# passes twice that): older skipped pairs stay out of the drafter's cache, so its proposals lose
# that far context and a long skip costs one short feed; outputs are exact regardless
CATCHUP_PAIRS = 8


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


@dataclass
class DraftRequest:
    """One slot's tree this round. The root is the slot's last committed token."""

    root_token: int
    root_position: int  # sequence position of the root
    depth: int  # draft levels at most (>= 1)
    width: int = 1  # dynamic trees: top-k per expansion and frontier size
    static: dict[tuple[int, ...], list[int]] | None = None  # static trees: node path -> child ranks
    noise: torch.Tensor | None = None  # (depth, V) coupled Gumbel rows of the drafted positions
    min_confidence: float = 0.0  # stop this slot once its expanded paths' confidences sum below this


@dataclass
class _Pending:
    tokens: list[int]
    hidden: list[torch.Tensor]  # pieces (cfg rows, P_i, dim): target states before each token
    first_position: int

    def recent(self, n: int) -> "_Pending":
        """The last n pairs (all when fewer)."""
        drop = max(0, len(self.tokens) - n)
        if drop == 0:
            return self
        return _Pending(self.tokens[drop:], [torch.cat(self.hidden, 1)[:, drop:]], self.first_position + drop)


class TreeProposer:
    def __init__(self, drafter: Drafter, head, cfg_scale: float, rows: int, max_len: int,
                 scorer: DraftScorer = DraftScorer()) -> None:
        self.drafter, self.head, self.cfg_scale, self.scorer = drafter, head, cfg_scale, scorer
        self.cache: KVCache = drafter.new_cache(rows, max_len)
        self.rows = rows
        self.cfg_rows = 2 if cfg_scale != 1.0 else 1
        self.slots = rows // self.cfg_rows
        self._pending: dict[int, _Pending] = {}
        self.forwards = 0  # drafter forward passes so far

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot indices (n,) -> their cache rows (cfg * n,), cond rows first."""
        return torch.cat([slots + c * self.slots for c in range(self.cfg_rows)])

    # ---- committed sequence -------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """A new image in `slot`: its rows start empty."""
        self._pending.pop(slot, None)
        lengths = self.cache.lengths.clone()
        lengths[self._rows(torch.tensor([slot], device=lengths.device))] = 0
        self.cache.set_lengths(lengths)

    def observe(self, slot: int, hidden: torch.Tensor, tokens: list[int], first_position: int) -> None:
        """Queue pairs (hidden[:, i], tokens[i]) at positions first_position + i for `slot`.

        hidden: (cfg rows, P, dim) target states at the positions BEFORE each token."""
        old = self._pending.get(slot)
        if old is None:
            self._pending[slot] = _Pending(list(tokens), [hidden], first_position)
        else:  # a round without drafting: the pairs wait for the next feed
            if old.first_position + len(old.tokens) != first_position:
                raise RuntimeError("observe() pairs must follow the queued ones")
            old.tokens += tokens
            old.hidden.append(hidden)
            if len(old.tokens) > 2 * CATCHUP_PAIRS:  # amortised: keep the recent pairs only
                self._pending[slot] = old.recent(CATCHUP_PAIRS)

    def _feed(self, slots: list[int]) -> torch.Tensor:
        """Run the queued pairs of `slots` in one padded forward; returns (R, dim): each row's
        last feature (rows of slots without pairs: zeros)."""
        dev = self.cache.k.device
        dim = self.drafter.config.dim
        out = torch.zeros(self.rows, dim, device=dev, dtype=self.cache.k.dtype)
        todo = [s for s in slots if s in self._pending]
        if not todo:
            return out
        p_max = max(len(self._pending[s].tokens) for s in todo)
        tok = torch.zeros(self.rows, p_max, dtype=torch.long, device=dev)
        hid = torch.zeros(self.rows, p_max, dim, device=dev, dtype=self.cache.k.dtype)
        pos = torch.zeros(self.rows, p_max, dtype=torch.long, device=dev)
        count = torch.zeros(self.rows, dtype=torch.long, device=dev)
        for s in todo:
            pend = self._pending.pop(s)
            p = len(pend.tokens)
            rows = self._rows(torch.tensor([s], device=dev))
            tok[rows, :p] = torch.tensor(pend.tokens, device=dev)
            hid[rows, :p] = torch.cat(pend.hidden, 1).to(dev, hid.dtype)
            pos[rows] = (pend.first_position + torch.arange(p_max, device=dev)).clamp(max=len(self.drafter.rope) - 1)
            count[rows] = p
        before = self.cache.lengths.clone()
        causal = torch.ones(p_max, p_max, dtype=torch.bool, device=dev).tril()
        feats = self.drafter(tok, hid, pos, self.cache.attn_mask(causal), self.cache)  # (R, P, dim)
        self.forwards += 1
        self.cache.set_lengths(before + count)
        last = (count - 1).clamp(min=0)
        out = feats[torch.arange(self.rows, device=dev), last]
        return torch.where((count > 0)[:, None], out, torch.zeros_like(out))

    # ---- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: dict[int, DraftRequest],
                level_gate: Callable[[int, dict[int, float], int], bool] | None = None) -> dict[int, CandidatePool]:
        """Draft every requested slot's candidates; returns {slot: candidate pool}.

        level_gate(level, {slot: summed path confidence of the nodes it would expand}, frontier
        tokens in total) -> whether to build that level at all (the batch cost budget)."""
        dev = self.cache.k.device
        slots = sorted(requests)
        root_feat = self._feed(slots)  # (R, dim)
        start = self.cache.lengths.clone()
        self._ragged_start = self.cache._uniform is None
        exp = {s: _Expansion(requests[s], dev) for s in slots}
        sel, score = self._score(root_feat[:, None], {s: 0 for s in slots}, requests)  # (B, 1, V) each
        for s in slots:
            exp[s].first_level(sel[s], score[s], root_feat[self._rows(torch.tensor([s], device=dev))])
        depth = max(r.depth for r in requests.values())
        for d in range(2, depth + 1):
            fronts = {s: e.frontier(d) for s, e in exp.items()}
            fronts = {s: f for s, f in fronts.items() if f is not None and f.numel()}
            if not fronts:
                break
            if level_gate is not None:
                conf = {s: float(exp[s].pool.scores[f].exp().sum()) for s, f in fronts.items()}
                if not level_gate(d, conf, sum(f.numel() for f in fronts.values())):
                    break
            feats = self._run_level(exp, fronts, d, start)  # (R, F_max, dim)
            sel, score = self._score(feats, {s: d - 1 for s in fronts}, requests)
            for s, f in fronts.items():
                n = f.numel()
                exp[s].add_level(sel[s, :n], score[s, :n], feats[self._rows(torch.tensor([s], device=dev)), :n], d)
        self.cache.truncate(start)
        return {s: e.pool.candidates() for s, e in exp.items()}

    def _score(self, features: torch.Tensor, level_of: dict[int, int], requests: dict[int, DraftRequest]):
        """features (R, F, dim) -> (select key, score), each (slots, F, V); noise row per slot."""
        mixed = cfg_mix(self.head(features), self.cfg_scale)  # (slots, F, V)
        noise = None
        if self.scorer.coupled is not None:
            noise = torch.zeros(self.slots, 1, mixed.shape[-1], device=mixed.device)
            for s, lv in level_of.items():
                nz = requests[s].noise
                if nz is not None:
                    noise[s, 0] = nz[lv]
        return self.scorer(mixed, noise)

    def _run_level(self, exp: dict[int, "_Expansion"], fronts: dict[int, torch.Tensor], d: int,
                   start: torch.Tensor) -> torch.Tensor:
        """One drafter forward over every slot's frontier (padded to the widest)."""
        dev = self.cache.k.device
        f_max = max(f.numel() for f in fronts.values())
        w = max(exp[s].processed.size for s in fronts) + f_max
        tok = torch.zeros(self.slots, f_max, dtype=torch.long, device=dev)
        pos = torch.zeros(self.slots, f_max, dtype=torch.long, device=dev)
        par = torch.zeros(self.rows, f_max, self.drafter.config.dim, device=dev, dtype=self.cache.k.dtype)
        mask = torch.zeros(self.slots, f_max, w, dtype=torch.bool, device=dev)
        count = torch.zeros(self.rows, dtype=torch.long, device=dev)
        for s, f in fronts.items():
            e, n = exp[s], f.numel()
            rows = self._rows(torch.tensor([s], device=dev))
            tok[s, :n] = e.pool.tokens[f]
            pos[s] = e.req.root_position + d - 1
            par[rows, :n] = e.parent_feat_of(f)
            m = e.processed.add(e.slot_of(f))  # (n, size + n)
            mask[s, :n, : m.shape[1]] = m
            count[rows] = n
        before = self.cache.lengths.clone()
        cat = lambda x: torch.cat([x] * self.cfg_rows)  # noqa: E731  slots -> rows
        since = start if self._ragged_start else int(start[0])  # rows of one length: the cheap mask
        feats = self.drafter(cat(tok), par, cat(pos), self.cache.attn_mask(cat(mask), since=since), self.cache)
        self.forwards += 1
        self.cache.set_lengths(before + count)
        return feats


class _Expansion:
    """One slot's tree under construction: its candidate pool and which nodes were fed."""

    def __init__(self, req: DraftRequest, device: torch.device) -> None:
        self.req = req
        self.pool = _Pool(device)
        self.processed = _ProcessedMask(device)
        self.level = torch.zeros(0, dtype=torch.long, device=device)  # (L,) pool indices of the last level
        self.front = self.level  # (F,) the nodes being fed for the next level
        self.feat: dict[int, torch.Tensor] = {}  # pool index -> (cfg, dim) feature of its parent
        self.fed_slot: dict[int, int] = {}  # pool index -> its slot in `processed`

    def _ranks(self, path: tuple[int, ...]) -> list[int]:
        if self.req.static is not None:
            return self.req.static.get(path, [])
        return list(range(self.req.width))

    def first_level(self, select: torch.Tensor, score: torch.Tensor, root_feat: torch.Tensor) -> None:
        """select/score (1, V) at the root; root_feat (cfg, dim) the slot's last committed feature."""
        self.level = self.pool.add_children(select, score, [-1], [()], self._ranks, depth=1)
        for c in self.level.tolist():
            self.feat[c] = root_feat

    def frontier(self, d: int) -> torch.Tensor | None:
        """Pool indices of the nodes to expand into level d (None: this slot is done)."""
        if d > self.req.depth or self.level.numel() == 0:
            return None
        scores = self.pool.scores[self.level]
        if self.req.static is not None:
            paths = [self.pool.paths[i] for i in self.level.tolist()]
            chosen = torch.tensor([i for i, p in enumerate(paths) if p in self.req.static], dtype=torch.long)
        else:
            chosen = top_frontier(scores, self.req.width).cpu()
        if chosen.numel() == 0:
            return None
        chosen = chosen.to(scores.device)
        # a new level adds at most P(the accepted path reaches it) = sum of the expanded paths' confidences
        if self.req.min_confidence > 0 and float(scores[chosen].exp().sum()) < self.req.min_confidence:
            return None
        self.front = self.level[chosen]
        return self.front

    def parent_feat_of(self, front: torch.Tensor) -> torch.Tensor:
        """(cfg, F, dim) features the frontier nodes are fed with (their parents' features)."""
        return torch.stack([self.feat[i] for i in front.tolist()], 1)

    def slot_of(self, front: torch.Tensor) -> torch.Tensor:
        """(F,) processed-mask slots of the frontier nodes' parents (-1 = the root)."""
        return torch.tensor([self.fed_slot.get(p, -1) for p in self.pool.parents[front].tolist()], dtype=torch.long)

    def add_level(self, select: torch.Tensor, score: torch.Tensor, feats: torch.Tensor, d: int) -> None:
        """select/score (F, V) at the F fed frontier nodes; feats (cfg, F, dim) their features."""
        front = self.front.tolist()
        base = self.processed.size - len(front)
        where = {i: j for j, i in enumerate(front)}
        for i, j in where.items():
            self.fed_slot[i] = base + j
        self.level = self.pool.add_children(select, score, front, [self.pool.paths[i] for i in front],
                                            self._ranks, depth=d)
        for c, p in zip(self.level.tolist(), self.pool.parents[self.level].tolist()):
            self.feat[c] = feats[:, where[p]]


class _Pool:
    """Growing candidate pool (see tree.CandidatePool) plus each candidate's rank path."""

    def __init__(self, device) -> None:
        self.device = device
        e = torch.zeros(0, dtype=torch.long, device=device)
        self.tokens, self.parents, self.depths, self.scores = e, e, e, torch.zeros(0, device=device)
        self.paths: list[tuple[int, ...]] = []

    def add_children(self, select, score, parents: list[int], parent_paths, ranks_of, depth: int) -> torch.Tensor:
        """select/score (F, V) at F expanded nodes -> append their children (top ranks of the
        select key, scored by the score); returns the new pool indices."""
        v = select.shape[-1]
        ranks = [[r for r in ranks_of(p) if r < v] for p in parent_paths]  # a node has at most V children
        kmax = max((max(r) + 1 for r in ranks if r), default=0)
        if kmax == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        top = torch.topk(select, kmax, dim=-1)  # (F, kmax)
        values = score.gather(-1, top.indices)  # (F, kmax)
        src = [f for f, rs in enumerate(ranks) for _ in rs]
        rank = [r for rs in ranks for r in rs]
        sf = torch.tensor(src, dtype=torch.long, device=self.device)
        sr = torch.tensor(rank, dtype=torch.long, device=self.device)
        par = torch.tensor(parents, dtype=torch.long, device=self.device)[sf]
        parent_score = torch.where(par >= 0, self.scores[par.clamp(min=0)] if self.scores.numel() else 0.0, 0.0)
        base = self.tokens.numel()
        self.tokens = torch.cat([self.tokens, top.indices[sf, sr]])
        self.parents = torch.cat([self.parents, par])
        self.depths = torch.cat([self.depths, torch.full_like(par, depth)])
        self.scores = torch.cat([self.scores, parent_score + values[sf, sr].float()])
        self.paths += [parent_paths[f] + (r,) for f, r in zip(src, rank)]
        return torch.arange(base, base + len(src), device=self.device)

    def candidates(self) -> CandidatePool:
        return CandidatePool(self.tokens, self.parents, self.depths, self.scores)


class _ProcessedMask:
    """Ancestor mask among tree nodes fed to the drafter (their slots follow the prefix)."""

    def __init__(self, device) -> None:
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    def add(self, parent_slots: torch.Tensor) -> torch.Tensor:
        """parent_slots (F,) (-1 = root) -> mask rows (F, n + F) for the new nodes."""
        n, f = self.mask.shape[0], parent_slots.numel()
        rows = torch.zeros(f, n + f, dtype=torch.bool, device=self.mask.device)
        has = parent_slots >= 0
        if bool(has.any()):
            rows[has.to(rows.device), :n] = self.mask[parent_slots[has].to(rows.device)]
        rows[:, n:] = torch.eye(f, dtype=torch.bool, device=rows.device)
        self.mask = torch.cat([torch.cat([self.mask, rows[:, :n].new_zeros(n, f)], 1), rows], 0)
        return rows
