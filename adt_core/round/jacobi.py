"""A draft source with no drafter model (method "jacobi"): the target's own earlier guesses.

Speculative Jacobi decoding (SJD and its successors) drafts the tokens ahead of an image's
committed prefix from what the target itself predicted there in earlier forwards. Here every
slot keeps a WINDOW of candidates per image index ahead of its prefix (`JacobiWindow`, a ring of
`ring` indices per slot, each with the `keep` best candidates and their log scores):

- after a verify forward, the node standing at image index t - 1 (the root, a drafted node)
  predicts index t; for every depth past the accepted path the window keeps the predictions of
  the best node at that depth below the last accepted node (or anywhere in the tree), scored as
  the method's drafts are (adt_core/draft.DraftScorer: coupled, the top-k of the warped logits
  plus the position's fixed Gumbel row; else of log p). The unaccepted tail's predictions are
  the next round's drafts (Jacobi's fixed-point iteration, one step per round);
- every index also takes the image's neighbours (adt_core/round/neighbours.py): the token above,
  the left neighbour repeated (the parent node's own token) and the left token's frequent
  continuations, each scored by how often it was right. Where the image is flat they are right
  most of the time, and chains of them reach past what the window's earlier predictions, made
  under a rejected prefix, do; the tree verifies them, and their predictions fill the window.
  A token proposed by two sources keeps the better score.

`propose` builds a CandidateBatch from the window as the drafter does from its levels: level j
holds the candidates of the slot's index n - 1 + j below each of the K best nodes of level
j - 1 by path score; EAGLE-2's rerank (tree.rerank_batch) then keeps the plan's M nodes. It is
tensor work over every slot at once, no model forward. Greedy and coupled verification need
nothing more (a committed token is the target's own draw whatever drafted it). The rejection
sampler drafts one chain per slot, each token SAMPLED from the window's stored distribution q
(the earlier forward's warped p at that index) and accepted by SJD's rule (`verify_sjd`).
"""

from __future__ import annotations

import numpy as np
import torch

from adt_core.config import SamplingConfig
from adt_core.round.draft import SCORE_FLOOR, DraftScorer
from adt_core.round.neighbours import ImagePrior, NeighbourOdds, merge_siblings, neighbour_candidates
from adt_core.round.state import CandidateBatch, RoundPlan, Slots, TreeBatch, Verified
from adt_core.round.sampling import target_probs
from adt_core.round.verify import VerifyResult

FAR = 1.0e7  # key bonus of nodes below the last accepted one when the carry picks a node per depth


class JacobiWindow:
    """Every slot's candidates for the image indices ahead of its committed prefix (device)."""

    forwards = 0  # no drafter model: nothing is run

    def __init__(self, slots: int, grid_w: int, keep: int, ring: int, scorer: DraftScorer,
                 sampling: SamplingConfig | None, vocab: int, device: torch.device, prior: ImagePrior) -> None:
        """keep: candidates stored per index (the widest expansion); ring: indices kept per slot
        (> the deepest tree + 1); sampling: set for the rejection sampler (it stores q rows)."""
        self.w, self.keep, self.ring, self.scorer, self.sampling = grid_w, keep, ring, scorer, sampling
        self.tok = torch.zeros(slots, ring + 1, keep, dtype=torch.long, device=device)  # column ring: sink
        self.score = torch.full((slots, ring + 1, keep), float("-inf"), device=device)
        self.stamp = torch.full((slots, ring + 1), -1, dtype=torch.long, device=device)  # image index held
        self.q = torch.zeros(slots, ring + 1, vocab, device=device) if sampling is not None else None
        self.chain_q: torch.Tensor | None = None  # (C, D + 1, V) q of each drafted depth (rejection)
        self.chain_has: torch.Tensor | None = None  # (C, D + 1) bool: depth j was drawn from a q row
        self.odds = NeighbourOdds(slots, grid_w, prior)

    def narrow(self, order: np.ndarray) -> None:
        """Keep slots `order` (n,) as slots 0 .. n - 1 (BatchDecoder.narrow)."""
        idx = torch.from_numpy(np.asarray(order, dtype=np.int64)).to(self.stamp.device)
        take = lambda x: None if x is None else x.index_select(0, idx)  # noqa: E731
        self.tok, self.score, self.stamp, self.q = (take(x) for x in (self.tok, self.score, self.stamp, self.q))
        self.chain_q, self.chain_has = take(self.chain_q), take(self.chain_has)
        self.odds.narrow(idx)

    def reset(self, slots) -> None:
        """Slots (bool (C,)) start with an empty window."""
        mask = torch.as_tensor(slots, device=self.stamp.device)
        self.stamp[mask] = -1
        self.odds.reset(mask)

    # ---- drafting ---------------------------------------------------------------------------
    def _lookup(self, slots: Slots, levels: int):
        """Window rows of the depth-1 .. D indices: index (C, D), held (C, D), tokens and scores
        (C, D, keep), the token above (C, D) and whether it is committed (C, D)."""
        idx = slots.count[:, None] - 1 + torch.arange(1, levels + 1, device=slots.count.device)  # (C, D)
        col = idx % self.ring
        held = self.stamp.gather(1, col) == idx
        g = col[..., None].expand(-1, -1, self.keep)
        tok, score = self.tok.gather(1, g), self.score.gather(1, g)
        score = torch.where(held[..., None], score, float("-inf"))
        up = idx - self.w
        up_ok = (up >= 0) & (up < slots.count[:, None])
        above = slots.tokens.gather(1, up.clamp(min=0))
        return idx, col, held, tok, score, above, up_ok

    @torch.inference_mode()
    def propose(self, plan: RoundPlan, slots: Slots, noise=None, static=None) -> CandidateBatch:
        """Every slot's candidates for this round (noise is unused: the window is already scored
        under it)."""
        if self.sampling is not None:
            return self._chain(plan, slots)
        dev = slots.count.device
        levels, width = plan.levels, plan.width
        depth = torch.from_numpy(plan.depth).to(dev)  # (C,)
        widths = torch.from_numpy(plan.widths).to(dev)  # (C,)
        _, _, _, tok, score, above, up_ok = self._lookup(slots, levels)
        odds = self.odds.scores(slots)  # (C, 3) log odds of the neighbours
        kw = min(width, self.keep)
        wrank = torch.arange(kw, device=dev) < widths[:, None, None]  # (C, 1, Kw) a slot's own k best
        win_s = _floored(torch.where(wrank, score[..., :kw], float("-inf")))  # (C, D, Kw)
        live = depth[:, None] >= torch.arange(1, levels + 1, device=dev)  # (C, D) slot drafts depth j
        c = tok.shape[0]
        parent_tok = slots.roots()[:, None]  # (C, F): level 1's parent is the root
        parent_score = torch.zeros(c, 1, device=dev)
        parent_idx = torch.full((c, 1), -1, dtype=torch.long, device=dev)
        parent_ok = torch.ones(c, 1, dtype=torch.bool, device=dev)
        pool: list[CandidateBatch] = []
        offset = 0
        for d in range(1, levels + 1):
            f = parent_tok.shape[1]
            near_t, near_s = neighbour_candidates(odds, self.odds.prior, parent_tok, above[:, d - 1, None],
                                                  up_ok[:, d - 1, None])  # (C, F, 2 + FOLLOW)
            # the window's k best, then the neighbours (C, F, Kc)
            kt = torch.cat([tok[:, d - 1, None, :kw].expand(c, f, kw), near_t], 2)
            ks = torch.cat([win_s[:, d - 1, None].expand(c, f, kw), _floored(near_s)], 2)
            kc = kt.shape[2]
            ks, ok = merge_siblings(kt, ks, torch.isfinite(ks))  # a token's best source
            ok &= (parent_ok & live[:, d - 1, None])[..., None]
            block = CandidateBatch(
                tokens=kt.reshape(c, f * kc),
                parents=parent_idx[..., None].expand(c, f, kc).reshape(c, f * kc),
                depths=torch.full((c, f * kc), d, dtype=torch.long, device=dev),
                scores=torch.where(ok, parent_score[..., None] + ks, 0.0).reshape(c, f * kc),
                valid=ok.reshape(c, f * kc))
            pool.append(block)
            if d == levels:
                break
            key = torch.where(block.valid, block.scores, float("-inf"))  # the K best by path score
            fi = torch.topk(key, min(width, key.shape[1]), dim=1).indices  # (C, F')
            fmask = torch.arange(fi.shape[1], device=dev) < widths[:, None]
            parent_tok, parent_score = block.tokens.gather(1, fi), block.scores.gather(1, fi)
            parent_ok = block.valid.gather(1, fi) & fmask
            parent_idx, offset = offset + fi, offset + block.tokens.shape[1]
        return CandidateBatch(*(torch.cat([getattr(b, f) for b in pool], 1)
                                for f in ("tokens", "parents", "depths", "scores", "valid")))

    def _chain(self, plan: RoundPlan, slots: Slots) -> CandidateBatch:
        """The rejection sampler's drafts: one chain per slot, depth j's token drawn from the
        window's q row of its index with the slot's own generator (an index never predicted: the
        token above, else the left neighbour's, deterministic: q a point mass)."""
        dev = slots.count.device
        levels = plan.levels
        depth = torch.from_numpy(plan.depth).to(dev)
        _, col, held, _, _, above, up_ok = self._lookup(slots, levels)
        c, v = col.shape[0], self.q.shape[2]
        q = self.q.gather(1, col[..., None].expand(-1, -1, v))  # (C, D, V)
        drawn = torch.zeros(c, levels, dtype=torch.long, device=dev)
        for b, g in enumerate(slots.gens):
            if g is not None and bool(slots.active[b]):
                drawn[b] = torch.multinomial(q[b].clamp(min=0) + (~held[b, :, None]).float(), 1, generator=g)[:, 0]
        tokens = torch.empty(c, levels, dtype=torch.long, device=dev)
        prev = slots.roots()
        for d in range(levels):  # a never-predicted index follows the chain's previous token
            fallback = torch.where(up_ok[:, d], above[:, d], prev)
            tokens[:, d] = prev = torch.where(held[:, d], drawn[:, d], fallback)
        self.chain_q = torch.cat([torch.zeros(c, 1, v, device=dev), q], 1)  # (C, D + 1, V): row j for depth j
        self.chain_has = torch.cat([torch.zeros(c, 1, dtype=torch.bool, device=dev), held], 1)
        j = torch.arange(levels, device=dev)
        return CandidateBatch(
            tokens=tokens, parents=(j - 1).expand(c, levels).contiguous(),
            depths=(j + 1).expand(c, levels).contiguous(),
            scores=-(j + 1).float().expand(c, levels) * 1e-3,  # kept shallowest first: a chain's prefix
            valid=(j + 1)[None] <= depth[:, None])

    # ---- after verification -------------------------------------------------------------------
    @torch.inference_mode()
    def carry(self, tree: TreeBatch, mixed: torch.Tensor, ver: Verified, noise: torch.Tensor | None,
              count: torch.Tensor, active: torch.Tensor, levels: int) -> None:
        """Store this forward's predictions for the indices past the accepted path.

        tree (C, n) as verified, mixed (C, n, V) its CFG-mixed target logits, ver the accepted
        path, noise (C, D + 1, V) the coupled rows of indices count .. count + D (or None),
        count (C,) committed tokens BEFORE this round's commit. The node at depth j predicts
        index count + j; per depth the best node below the last accepted one is used (else the
        best at that depth), for every depth past the accepted count."""
        c, n = tree.tokens.shape
        dev = tree.tokens.device
        last = ver.path.gather(1, ver.accepted[:, None])  # (C, 1) tree index of the last accepted node
        below = tree.mask.gather(2, last[:, :, None].expand(c, n, 1))[..., 0]  # (C, n) last is an ancestor
        key = torch.where(tree.valid, tree.scores.float() + torch.where(below, FAR, 0.0), float("-inf"))
        at = tree.depths[..., None] == torch.arange(levels + 1, device=dev)  # (C, n, D + 1)
        best = torch.where(at, key[..., None], float("-inf")).max(1)  # (C, D + 1)
        j = torch.arange(levels + 1, device=dev)
        ok = torch.isfinite(best.values) & (j > ver.accepted[:, None]) & active[:, None]
        rows = mixed.gather(1, best.indices[..., None].expand(-1, -1, mixed.shape[2]))  # (C, D + 1, V)
        index = count[:, None] + j  # (C, D + 1) the index each row predicts
        col = torch.where(ok, index % self.ring, self.ring)
        self.stamp.scatter_(1, col, index)
        if self.q is not None:
            self.q.scatter_(1, col[..., None].expand(-1, -1, self.q.shape[2]), target_probs(rows, self.sampling))
            return
        sel, score = self.scorer(rows, None if noise is None else noise[:, : levels + 1])
        top = torch.topk(sel, min(self.keep, sel.shape[-1]), dim=-1)  # (C, D + 1, keep)
        g = col[..., None].expand(-1, -1, top.indices.shape[2])
        self.tok[:, :, : g.shape[2]].scatter_(1, g, top.indices)
        self.score[:, :, : g.shape[2]].scatter_(1, g, score.float().gather(-1, top.indices))


def _floored(score: torch.Tensor) -> torch.Tensor:
    """Finite scores raised to the drafter's floor; the rest -inf."""
    return score.clamp(min=SCORE_FLOOR).masked_fill(~torch.isfinite(score), float("-inf"))


def verify_sjd(tokens: list[int], depths: list[int], logits: torch.Tensor, sampling: SamplingConfig,
               gen: torch.Generator | None, q: torch.Tensor, has_q: list[bool]) -> VerifyResult:
    """SJD's rule down one slot's chain (node i at depth i, root 0).

    logits (n, V) CFG-mixed target logits at the chain's nodes; q (D + 1, V) the distribution
    depth j's token was drawn from where has_q[j] (else the token was deterministic: q a point
    mass). Accept x with probability min(1, p(x) / q(x)); on the first rejection draw the
    bonus token from max(p - q, 0) renormalised (p without x for a point mass); after the last
    node, from p. Each committed token is distributed as p given the tokens before it."""
    node, accepted = 0, []
    for i in range(1, len(tokens)):
        p = target_probs(logits[node], sampling)  # (V,)
        x, d = tokens[i], depths[i]
        qx = float(q[d, x]) if has_q[d] else 1.0
        a = min(1.0, float(p[x]) / qx) if qx > 0 else 0.0
        if float(torch.rand((), generator=gen, device=p.device)) < a:
            accepted.append(i)
            node = i
            continue
        if has_q[d]:
            residual = (p - q[d].to(p.dtype)).clamp(min=0)
        else:
            residual = p.clone()
            residual[x] = 0.0
        if float(residual.sum()) <= 0.0:
            residual = p
        return VerifyResult(accepted, int(torch.multinomial(residual, 1, generator=gen)))
    p = target_probs(logits[node], sampling)
    return VerifyResult(accepted, int(torch.multinomial(p, 1, generator=gen)))


def window_ring(config) -> int:
    """Image indices a slot's window holds: past the deepest tree plus its bonus, twice over."""
    return max(32, 2 * (config.adaptive.d_max + 2))


def jacobi_window(config, setup, capacity: int, grid_w: int) -> JacobiWindow:
    """The window of a BatchDecoder (its DecodeSetup and capacity)."""
    sampler = setup.sampler
    rejection = sampler.sampling if sampler.kind == "rejection" else None
    return JacobiWindow(capacity, grid_w, config.adaptive.k_max, window_ring(config), setup.scorer, rejection,
                        sampler.vocab, setup.device, setup.prior)


def window_bytes(config, vocab: int, rejection: bool) -> int:
    """Device bytes of one slot's window (the memory plan's per-image share)."""
    ring = window_ring(config) + 1
    per_index = config.adaptive.k_max * (8 + 4) + 8 + (vocab * 4 if rejection else 0)
    return ring * per_index
