"""The drafter-free method's neighbour candidates (adt_core/round/neighbours.py): what the counts
learn from committed tokens, and how the window ranks them. Outputs never depend on them (the
exactness of method "jacobi" is tested with every round test)."""

import math

import numpy as np
import pytest
import torch

from adt_core.round.neighbours import ImagePrior, NeighbourOdds, merge_siblings, neighbour_candidates
from adt_core.round.state import Slots


def _slots(grids: list[list[int]], upto: list[int]) -> Slots:
    """Slots holding grids[b][:upto[b]] committed."""
    s = Slots.empty(len(grids), len(grids[0]), torch.device("cpu"))
    for b, (g, n) in enumerate(zip(grids, upto)):
        s.tokens[b, :n] = torch.tensor(g[:n])
        s.count[b] = n
        s.host_count[b], s.active[b] = n, True
    return s


def test_continuations_count_each_tokens_followers_and_their_share():
    prior = ImagePrior(vocab=8, device=torch.device("cpu"))
    prev = torch.tensor([[1, 1, 1, 1, 2, 2]])
    nxt = torch.tensor([[3, 3, 3, 5, 7, 7]])
    ok = torch.tensor([[True, True, True, True, True, False]])  # the last pair is not committed
    prior.count_pairs(prev, nxt, ok)
    tok, logp = prior.continuations(torch.tensor([1, 2, 4]))
    share = {int(t): math.exp(float(s)) for t, s in zip(tok[0], logp[0]) if math.isfinite(float(s))}
    assert share == pytest.approx({3: 0.75, 5: 0.25})
    assert {int(t) for t, s in zip(tok[1], logp[1]) if math.isfinite(float(s))} == {7}
    assert not torch.isfinite(logp[2]).any()  # token 4 was never followed
    prior.count_pairs(torch.tensor([[1]]), torch.tensor([[5]]), torch.tensor([[True]]))  # a held pair adds up
    tok, logp = prior.continuations(torch.tensor([1]))
    share = {int(t): math.exp(float(s)) for t, s in zip(tok[0], logp[0]) if math.isfinite(float(s))}
    assert share == pytest.approx({3: 0.6, 5: 0.4})
    # a full row: new pairs, most counted first, take the least counted entries; shares stay of every pair
    pairs = torch.tensor([[0, 0, 0, 4, 4, 6, 6, 6, 6]])
    prior.count_pairs(torch.ones_like(pairs), pairs, torch.ones_like(pairs, dtype=torch.bool))
    tok, logp = prior.continuations(torch.tensor([1]))
    share = {int(t): math.exp(float(s)) for t, s in zip(tok[0], logp[0]) if math.isfinite(float(s))}
    assert share == pytest.approx({3: 3 / 14, 4: 2 / 14, 6: 4 / 14, 0: 3 / 14})  # 4 took 5's entry (2 pairs each)
    # a held pair and a new one of the same token in one call: the held entry is not given away
    prior.count_pairs(torch.tensor([[1, 1]]), torch.tensor([[3, 7]]), torch.ones(1, 2, dtype=torch.bool))
    tok, logp = prior.continuations(torch.tensor([1]))
    share = {int(t): math.exp(float(s)) for t, s in zip(tok[0], logp[0]) if math.isfinite(float(s))}
    assert share == pytest.approx({3: 4 / 16, 7: 1 / 16, 6: 4 / 16, 0: 3 / 16})


def test_odds_learn_a_flat_image_and_a_striped_one_apart_counting_each_index_once():
    w = 4
    flat = [7] * 16  # every index: left and above agree and are right
    stripes = [r % 2 for r in range(4) for _ in range(w)]  # rows alternate 0 / 1: left right, above wrong
    prior = ImagePrior(vocab=8, device=torch.device("cpu"))
    odds = NeighbourOdds(2, w, prior)
    s = _slots([flat, stripes], [10, 10])
    first = odds.scores(s).exp()
    again = odds.scores(s).exp()  # nothing new committed: the counts stand (decayed, not recounted)
    assert odds.n[0, 0] < 9 + 1e-6 and torch.all(odds.upto == 10)
    assert first[0, 0] > 0.6 and first[0, 0] > prior.rate()[0] - 1e-6  # flat: agreeing neighbours are right
    assert first[1, 1] > first[1, 2]  # stripes: the left neighbour beats the token above
    s = _slots([flat, stripes], [16, 16])
    later = odds.scores(s).exp()
    assert later[0, 0] > again[0, 0] and later[1, 2] < first[1, 2]
    odds.reset(torch.tensor([True, False]))
    assert odds.n[0].sum() == 0 and odds.upto[0] == 0 and odds.upto[1] == 16


def test_neighbour_candidates_score_agreeing_neighbours_as_one_and_merge_keeps_the_best_copy():
    prior = ImagePrior(vocab=8, device=torch.device("cpu"))
    prior.count_pairs(torch.tensor([[2, 2]]), torch.tensor([[6, 6]]), torch.tensor([[True, True]]))
    odds = torch.log(torch.tensor([[0.9, 0.3, 0.2]]))  # agree, left, above
    parent = torch.tensor([[2, 5]])  # (C 1, F 2)
    tok, score = neighbour_candidates(odds, prior, parent, above=torch.tensor([[2]]), has_up=torch.tensor([[True]]))
    assert tok[0, 0, :2].tolist() == [2, 2] and torch.allclose(score[0, 0, :2].exp(), torch.tensor([0.9, 0.9]))
    assert tok[0, 1, :2].tolist() == [2, 5] and torch.allclose(score[0, 1, :2].exp(), torch.tensor([0.2, 0.3]))
    assert tok[0, 0, 2] == 6 and torch.isclose(score[0, 0, 2].exp(), torch.tensor(1.0))  # 2 was always followed by 6
    window = torch.tensor([[[5, 2], [3, 4]]])  # the window's own candidates first, then the neighbours
    wscore = torch.log(torch.tensor([[[0.5, 0.1], [0.6, 0.2]]]))
    kt, ks = torch.cat([window, tok], 2), torch.cat([wscore, score], 2)
    best, live = merge_siblings(kt, ks, torch.isfinite(ks))
    # parent 2: token 2 stands once (the window's copy, at the neighbours' better 0.9)
    assert live[0, 0].tolist()[:4] == [True, True, False, False]
    assert torch.isclose(best[0, 0, 1].exp(), torch.tensor(0.9))
    # parent 5: its tokens differ from the window's and stand with their own scores
    assert live[0, 1, :4].tolist() == [True, True, True, True]
    assert np.allclose(best[0, 1, :4].exp().tolist(), [0.6, 0.2, 0.2, 0.3])
