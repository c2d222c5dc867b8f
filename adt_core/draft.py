"""The drafter side of speculative decoding: propose a tree, observe what was accepted.

`TreeProposer` drives an EAGLE-style `Drafter` with its own KV cache holding the accepted
prefix. `observe` queues the (target hidden state, next token) pairs of newly committed tokens;
`propose` first feeds those pairs, then expands a tree level by level under a tree mask,
then forgets the tree nodes again (the cache keeps only committed pairs).

Expansion shapes:
- EAGLE-2 dynamic (`propose_dynamic`): level 1 = top-k children of the root; each next level
  expands the k best candidates of the previous level by cumulative log-probability into k
  children each; finally the `budget` best candidates overall are kept (rerank).
- static (`propose_static`): a fixed tree given as paths of child ranks.
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Callable

import torch

from adt_core.config import SamplingConfig
from adt_core.kv_cache import KVCache
from adt_core.models.drafter import Drafter
from adt_core.sampling import cfg_mix, warp
from adt_core.tree import CandidatePool, DraftTree, rerank, static_children, top_frontier

SCORE_FLOOR = -1e4  # log-score floor: a child of a removed (-inf) token still scores below its parent


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
        """mixed (F, V) draft logits, noise (V,) or None -> (select key (F, V), score (F, V))."""
        if self.coupled is None or noise is None:
            logq = mixed.float().log_softmax(-1)
            return logq, logq
        warped = warp(mixed, self.coupled)  # (F, V), removed tokens -inf
        pert = warped + noise.to(warped.dtype)
        score = (pert if self.perturbed else warped).log_softmax(-1).clamp(min=SCORE_FLOOR)
        return pert, score


class TreeProposer:
    def __init__(self, drafter: Drafter, head, cfg_scale: float, rows: int, max_len: int,
                 scorer: DraftScorer = DraftScorer()) -> None:
        self.drafter, self.head, self.cfg_scale, self.scorer = drafter, head, cfg_scale, scorer
        self.cache: KVCache = drafter.new_cache(rows, max_len)
        self.rows = rows
        self._pending: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.forwards = 0  # drafter forward passes so far

    # ---- committed sequence -------------------------------------------------------------
    def observe(self, hidden: torch.Tensor, tokens: list[int], first_position: int) -> None:
        """Queue pairs (hidden[:, i], tokens[i]) for positions first_position + i.

        hidden: (R, P, dim) target states at the positions BEFORE each token.
        """
        dev = hidden.device
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)[None].expand(self.rows, -1)  # (R, P)
        self._pending = (tok, hidden, first_position)

    def _feed_pending(self) -> torch.Tensor:
        """Run queued pairs into the cache; returns the last feature (R, dim)."""
        if self._pending is None:
            raise RuntimeError("propose() before observe()")
        tok, hidden, pos0 = self._pending
        p = tok.shape[1]
        positions = torch.arange(pos0, pos0 + p, device=tok.device)
        causal = torch.ones(p, p, dtype=torch.bool, device=tok.device).tril()
        feats = self.drafter(tok, hidden, positions, self.cache.attn_mask(causal), self.cache)  # (R, P, dim)
        self.forwards += 1
        self._pending = None
        return feats[:, -1]

    # ---- drafting -----------------------------------------------------------------------
    def _score(self, features: torch.Tensor, noise: torch.Tensor | None, level: int):
        """features (R, F, dim) -> (select key, score), each (F, V), for children at depth `level`.

        noise: (levels, V) Gumbel rows of the drafted positions (row level - 1), or None."""
        row = None if noise is None else noise[level - 1]
        return self.scorer(cfg_mix(self.head(features), self.cfg_scale)[0], row)

    def _run_level(self, tokens: torch.Tensor, parent_feats: torch.Tensor, position: int,
                   tree_mask: torch.Tensor, start: int) -> torch.Tensor:
        """Feed F frontier nodes (tokens (F,), parent features (R, F, dim)) -> features (R, F, dim)."""
        f = tokens.numel()
        pos = torch.full((f,), position, dtype=torch.long, device=tokens.device)
        mask = self.cache.attn_mask(tree_mask, since=start)
        feats = self.drafter(tokens[None].expand(self.rows, -1), parent_feats, pos, mask, self.cache)
        self.forwards += 1
        return feats

    def propose_dynamic(self, root_token: int, root_position: int, depth: int, top_k: int,
                        budget: int | Callable[[torch.Tensor, int], int], min_confidence: float = 0.0,
                        noise: torch.Tensor | None = None) -> DraftTree:
        """EAGLE-2: expand the top_k best of each level into top_k children; keep `budget` nodes
        (or `budget(candidate scores, levels built)` nodes when it is a function: the cost-aware
        budget).
        Expansion stops early once the path confidences of the nodes a new level would expand sum
        to less than `min_confidence` (0 = always build `depth` levels).
        noise: (depth, V) Gumbel rows of the drafted positions for coupled drafting, or None."""
        root_feat = self._feed_pending()  # (R, dim)
        return self._expand(
            root_token, root_position, root_feat, depth, budget, min_confidence, noise,
            pick=lambda scores, paths: top_frontier(scores, top_k),
            ranks_of=lambda path: list(range(top_k)),
        )

    def propose_static(self, root_token: int, root_position: int, paths: tuple[tuple[int, ...], ...], depth: int,
                       noise: torch.Tensor | None = None) -> DraftTree:
        """A fixed tree: node path -> child ranks from `paths` (levels beyond `depth` dropped)."""
        root_feat = self._feed_pending()
        shape = static_children(tuple(p for p in paths if len(p) <= depth))
        return self._expand(
            root_token, root_position, root_feat, depth, len(paths), 0.0, noise,
            pick=lambda scores, node_paths: torch.tensor(
                [i for i, p in enumerate(node_paths) if p in shape], dtype=torch.long, device=scores.device),
            ranks_of=lambda path: shape.get(path, []),
        )

    def _expand(self, root_token, root_position, root_feat, depth, budget, min_confidence, noise, pick,
                ranks_of) -> DraftTree:
        """Level-by-level expansion shared by every tree shape.

        pick(level_scores (L,), level_paths) -> which of the level's candidates to expand;
        ranks_of(path) -> the child ranks (0 = the drafter's best) a node gets.
        """
        start = self.cache.length
        pool = _Pool(root_feat.device)
        level, src = pool.add_children(self._score(root_feat[:, None], noise, 1), [-1], [()], ranks_of, depth=1)
        parent_feat = root_feat[:, None].expand(-1, level.numel(), -1)  # (R, L, dim) feature of each one's parent
        parent_slot = torch.full((level.numel(),), -1, dtype=torch.long)
        processed = _ProcessedMask(root_feat.device)
        for d in range(2, depth + 1):
            chosen = pick(pool.scores[level], [pool.paths[i] for i in level.tolist()])  # (F,) into level
            if chosen.numel() == 0:
                break
            # a new level adds at most P(the accepted path reaches it) = sum of the expanded paths' confidences
            if min_confidence > 0 and float(pool.scores[level[chosen]].exp().sum()) < min_confidence:
                break
            front = level[chosen]  # (F,) pool indices
            rows, slots = processed.add(parent_slot[chosen.cpu()])
            feats = self._run_level(pool.tokens[front], parent_feat[:, chosen], root_position + d - 1, rows, start)
            level, src = pool.add_children(self._score(feats, noise, d), front.tolist(),
                                           [pool.paths[i] for i in front.tolist()], ranks_of, depth=d)
            if level.numel() == 0:
                break
            parent_feat = feats[:, src]  # (R, L, dim)
            parent_slot = slots[src.cpu()]
        self.cache.truncate(start)
        n = budget(pool.scores, int(pool.depths.max())) if callable(budget) else budget
        return rerank(pool.candidates(), n, root_token, root_position)


class _Pool:
    """Growing candidate pool (see tree.CandidatePool) plus each candidate's rank path."""

    def __init__(self, device) -> None:
        self.device = device
        e = torch.zeros(0, dtype=torch.long, device=device)
        self.tokens, self.parents, self.depths, self.scores = e, e, e, torch.zeros(0, device=device)
        self.paths: list[tuple[int, ...]] = []

    def add_children(self, scored, parents: list[int], parent_paths, ranks_of, depth: int):
        """scored = (select key, score), each (F, V), of F expanded nodes -> append their children
        (top ranks of the key, scored by the score); return (new pool idx, src row)."""
        select, score = scored
        v = select.shape[-1]
        ranks = [[r for r in ranks_of(p) if r < v] for p in parent_paths]  # a node has at most V children
        kmax = max((max(r) + 1 for r in ranks if r), default=0)
        if kmax == 0:
            e = torch.zeros(0, dtype=torch.long, device=self.device)
            return e, e
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
        return torch.arange(base, base + len(src), device=self.device), sf

    def candidates(self) -> CandidatePool:
        return CandidatePool(self.tokens, self.parents, self.depths, self.scores)


class _ProcessedMask:
    """Ancestor mask among tree nodes fed to the drafter (their slots follow the prefix)."""

    def __init__(self, device) -> None:
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)

    def add(self, parent_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """parent_slots (F,) (-1 = root) -> mask rows (F, n + F) for the new nodes, their slots (F,)."""
        n, f = self.mask.shape[0], parent_slots.numel()
        rows = torch.zeros(f, n + f, dtype=torch.bool, device=self.mask.device)
        has = parent_slots >= 0
        if bool(has.any()):
            rows[has.to(rows.device), :n] = self.mask[parent_slots[has].to(rows.device)]
        rows[:, n:] = torch.eye(f, dtype=torch.bool, device=rows.device)
        self.mask = torch.cat([torch.cat([self.mask, rows[:, :n].new_zeros(n, f)], 1), rows], 0)
        return rows, torch.arange(n, n + f)
