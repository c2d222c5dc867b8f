"""What an image's committed tokens say about its next one: the drafter-free method's neighbour
candidates (adt_core/round/jacobi.py), learned as images are decoded. Device tensors only: the
counts are updated by whole-batch tensor work, never read on the host.

Three candidates stand at every image index i besides the target's own earlier predictions:
- the token above, x[i - W] (committed: one grid row up);
- the left neighbour repeated, x[i - 1] (the parent node's token);
- the left neighbour's continuations: the tokens committed right after x[i - 1] most often, in
  any image this Generator has decoded (`ImagePrior.continuations`; an n-gram pool of order 2,
  as lookahead decoding keeps one for text).

Each is scored by how often it was right. For the two neighbours that is counted per slot
(`NeighbourOdds`: a region's odds, decaying over about two grid rows) and split by whether the
two agree (x[i - 1] = x[i - W]: then is x[i] that token; else is it x[i - 1], is it x[i - W]),
shrunk towards the Generator's pooled odds; a continuation scores its share of its token's
counted pairs. On emoji16 at T 0 (48 images) the left neighbour was right 69% of the time, the
token above 60%, either 82%, either or one of the 3 most frequent continuations 92%.
"""

from __future__ import annotations

import functools

import torch

from adt_core.round.state import Slots

ODDS_PRIOR = (0.5, 0.15, 0.25)  # before any image: P(x[i] is) the common token where left and above
# agree; the left neighbour where they differ; the token above where they differ
ODDS_DECAY = 0.1  # a slot's odds forget at this rate per drafted round (about its last two grid rows)
POOL_DECAY = 0.01  # the Generator's pooled odds forget at this rate per drafted round
ODDS_WEIGHT = 4.0  # pseudo-events of the pooled odds in a slot's estimate
FOLLOW = 4  # continuations kept per token


class ImagePrior:
    """What every image decoded so far says (one per Generator, kept across its decoders):
    the pooled neighbour odds and each token's most frequent continuations."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.pool_hits = torch.tensor(ODDS_PRIOR, device=device)  # (3,) decayed events that hit
        self.pool_n = torch.ones(3, device=device)  # (3,) decayed events
        self.follow = torch.zeros(vocab + 1, FOLLOW, dtype=torch.long, device=device)  # (V + 1, F) row V: sink
        self.follow_n = torch.zeros(vocab + 1, FOLLOW, device=device)  # (V + 1, F) counts of each pair
        self.follow_all = torch.zeros(vocab + 1, device=device)  # (V + 1,) counted pairs of each token
        self.follow_s = torch.full((vocab + 1, FOLLOW), float("-inf"), device=device)  # (V + 1, F) log share

    def rate(self) -> torch.Tensor:
        """(3,) pooled P(hit) of the agree, left and above events."""
        return self.pool_hits / self.pool_n

    def pool(self, hits: torch.Tensor, n: torch.Tensor) -> None:
        """Add one round's (3,) events and hits."""
        self.pool_n.mul_(1 - POOL_DECAY).add_(n)
        self.pool_hits.mul_(1 - POOL_DECAY).add_(hits)

    def continuations(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tok (...) -> the tokens committed right after it most often (..., F) and the log of
        their share of its counted pairs (-inf where none)."""
        t = tok.clamp(0, self.follow.shape[0] - 2)
        return self.follow[t], self.follow_s[t]

    def count_pairs(self, prev: torch.Tensor, nxt: torch.Tensor, ok: torch.Tensor) -> None:
        """Count committed pairs (prev, next), each (C, S), where ok. A pair already held adds to
        its count; new pairs of a token, most counted first, replace its least counted entries
        (not held this call), starting at their own count: a table of each token's most frequent
        and most recent continuations, whose shares are of every pair counted. Fixed shapes
        throughout (sorts and run lengths, no `unique`): no host read."""
        size, sink = self.follow.shape[0], self.follow.shape[0] - 1
        key, _ = torch.where(ok, prev * size + nxt, sink * size).flatten().sort()  # (P,) equal pairs adjacent
        first, n = _runs(key)  # (P,) a run's first entry, its length there (0 elsewhere)
        p = torch.where(first, key // size, sink)  # one entry per distinct pair, the rest at the sink
        x, n = key % size, n.to(self.follow_n.dtype)
        self.follow_all.index_put_((p,), n, accumulate=True)
        match = (self.follow[p] == x[:, None]) & (self.follow_n[p] > 0)  # (P, F)
        held = match.any(1)
        entry = match.float().argmax(1)
        self.follow_n.index_put_((p, entry), torch.where(held, n, 0.0), accumulate=True)
        # the entries held pairs matched (the others write to the sink: one writer per entry)
        taken = torch.zeros_like(self.follow_n, dtype=torch.bool).index_put_((torch.where(held, p, sink), entry), held)
        order = torch.where(taken, float("inf"), self.follow_n).argsort(1)  # (V + 1, F) free entries first
        # new pairs, by token and most counted first: the r-th takes its token's r-th free entry
        q = torch.where(held, sink, p)
        by_n = (-n).argsort(stable=True)
        by = by_n[q[by_n].argsort(stable=True)]  # (P,)
        qs = q[by]
        start, _ = _runs(qs)
        rank = torch.arange(qs.numel(), device=qs.device) - torch.cummax(torch.where(start, torch.arange(
            qs.numel(), device=qs.device), 0), 0).values
        fits = (qs != sink) & (rank < FOLLOW - taken[qs].sum(1))
        qs = torch.where(fits, qs, sink)
        slot = order[qs, rank.clamp(max=FOLLOW - 1)]
        self.follow[qs, slot] = x[by]
        self.follow_n[qs, slot] = n[by]
        self.follow_n[sink], self.follow_all[sink] = 0.0, 0.0
        self.follow_s = (self.follow_n / self.follow_all[:, None].clamp(min=1.0)).log()


class NeighbourOdds:
    """Per slot: how often the left neighbour and the token above were the committed token
    (decayed counts of the agree / left / above events, (C, 3)), shrunk towards the pooled odds."""

    def __init__(self, slots: int, grid_w: int, prior: ImagePrior) -> None:
        self.w, self.prior = grid_w, prior
        device = prior.pool_n.device
        self.hits = torch.zeros(slots, 3, device=device)  # (C, 3) decayed events that hit
        self.n = torch.zeros(slots, 3, device=device)  # (C, 3) decayed events
        self.upto = torch.zeros(slots, dtype=torch.long, device=device)  # indices before this are counted

    def narrow(self, idx: torch.Tensor) -> None:
        """Keep slots idx (n,) as 0 .. n - 1."""
        self.hits, self.n, self.upto = (x.index_select(0, idx) for x in (self.hits, self.n, self.upto))

    def reset(self, mask: torch.Tensor) -> None:
        """Slots mask (C,) bool start a new image."""
        self.hits[mask], self.n[mask], self.upto[mask] = 0.0, 0.0, 0

    def scores(self, slots: Slots) -> torch.Tensor:
        """(C, 3) log P(hit) of the agree, left and above events, after counting the indices
        committed since the last call."""
        self._count(slots)
        rate = (self.hits + ODDS_WEIGHT * self.prior.rate()) / (self.n + ODDS_WEIGHT)
        return rate.clamp(min=1e-4).log()

    def _count(self, slots: Slots) -> None:
        """Count the indices committed since the last call (at most the last two grid rows:
        after a long run of plain steps the older ones stay uncounted)."""
        span = 2 * self.w
        idx = slots.count[:, None] - span + torch.arange(span, device=slots.count.device)  # (C, S)
        ok = (idx >= self.upto[:, None]) & (idx >= 1)
        at = lambda i: slots.tokens.gather(1, i.clamp(min=0))  # noqa: E731
        x, left, up = at(idx), at(idx - 1), at(idx - self.w)  # (C, S) each
        has_up = ok & (idx >= self.w)
        agree = has_up & (left == up)
        apart = ok & ~agree
        events = torch.stack([agree, apart, apart & has_up], 2)  # (C, S, 3)
        hit = events & torch.stack([x == left, x == left, x == up], 2)
        n, h = events.sum(1).float(), hit.sum(1).float()  # (C, 3)
        self.n.mul_(1 - ODDS_DECAY).add_(n)
        self.hits.mul_(1 - ODDS_DECAY).add_(h)
        self.prior.pool(h.sum(0), n.sum(0))
        self.prior.count_pairs(left, x, ok)
        self.upto = torch.maximum(self.upto, slots.count)


def neighbour_candidates(odds: torch.Tensor, prior: ImagePrior, parent: torch.Tensor, above: torch.Tensor,
                         has_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The neighbour candidates below F nodes of one tree level.

    odds (C, 3) `NeighbourOdds.scores`; parent (C, F) the nodes' tokens (the left neighbour of
    the index their children stand at); above (C, 1) the token above that index, has_up (C, 1)
    whether it is committed. Returns tokens and log scores (C, F, 2 + FOLLOW): the token above,
    the parent's token repeated, its continuations (-inf: no candidate)."""
    agree_s, left_s, above_s = (x[:, None] for x in odds.unbind(1))  # (C, 1) each
    agree = has_up & (parent == above)  # (C, F) the two neighbours are one token
    up_s = torch.where(agree, agree_s, above_s).masked_fill(~has_up, float("-inf"))
    cont_t, cont_s = prior.continuations(parent)  # (C, F, FOLLOW)
    tokens = torch.cat([above[..., None].expand_as(parent[..., None]), parent[..., None], cont_t], 2)
    scores = torch.cat([up_s[..., None], torch.where(agree, agree_s, left_s)[..., None], cont_s], 2)
    return tokens, scores


def merge_siblings(tokens: torch.Tensor, scores: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Siblings (C, F, K) from several sources: each live token takes the best score any of its
    copies has, and only its first live copy stays live (siblings carry distinct tokens).
    Returns (scores, live)."""
    same = (tokens[..., :, None] == tokens[..., None, :]) & live[..., None, :]  # (C, F, K, K)
    best = torch.where(same, scores[..., None, :], float("-inf")).amax(-1)
    earlier = _earlier(same.shape[-1], str(same.device))
    return torch.where(live, best, scores), live & ~(same & earlier).any(-1)


def _runs(sorted_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) sorted values -> (P,) bool whether each starts a run of equal values, (P,) long the
    run's length at its start (0 elsewhere)."""
    m = sorted_key.numel()
    i = torch.arange(m, device=sorted_key.device)
    start = torch.ones(m, dtype=torch.bool, device=sorted_key.device)
    start[1:] = sorted_key[1:] != sorted_key[:-1]
    nxt = torch.where(start, i, m).flip(0).cummin(0).values.flip(0)  # the first start at or after i
    after = torch.cat([nxt[1:], nxt.new_tensor([m])])  # the next run's start, seen from a start
    return start, torch.where(start, after - i, 0)


@functools.lru_cache(maxsize=None)
def _earlier(k: int, device: str) -> torch.Tensor:
    """(K, K) the strictly lower triangle: candidate j stands before candidate i."""
    return torch.ones(k, k, dtype=torch.bool, device=device).tril(-1)
