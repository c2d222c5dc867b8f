"""Tree helpers: ancestor mask, a slot's children, reranking closure, static shapes."""

import torch

from adt_core.config import TreeConfig, default_static_paths
from adt_core.round.state import CandidateBatch
from adt_core.round.tree import ancestor_mask_batch, rerank_batch, static_children
from tree_fixtures import one_tree


def test_ancestor_mask():
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    m = ancestor_mask_batch(parents, 3)[0]
    assert m[4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert m.diagonal().all() and not m.triu(1).any()


def test_children_ordered_by_score():
    tree = one_tree([0, 1, 2, 3], [-1, 0, 0, 0], [0, 1, 1, 1], [0.0, -2.0, -0.5, -1.0])
    assert tree.children(0) == [[2, 3, 1], [], [], []]


def test_rerank_keeps_best_and_is_ancestor_closed():
    # pool: 3 children of root, then children of pool 0 and pool 1
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1, 3]])
    depths = torch.tensor([[1, 1, 1, 2, 2, 2, 3]])
    scores = torch.tensor([[-0.1, -1.0, -3.0, -0.2, -2.5, -1.5, -0.2]])  # note a tie: pool 3 and 6
    pool = CandidateBatch(tokens, parents, depths, scores, torch.ones(1, 7, dtype=torch.bool))
    tree = rerank_batch(pool, 4, torch.tensor([4]), torch.tensor([1]), 3)
    assert tree.tokens[0].tolist() == [1, 5, 6, 8, 11]
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 3]
    assert tree.depths[0].tolist() == [0, 1, 1, 2, 3]
    assert torch.equal(tree.mask, ancestor_mask_batch(tree.parents, 3))


def test_static_shape_helpers():
    paths = default_static_paths()
    shape = static_children(paths)
    assert shape[()] == list(range(6))
    assert shape[(0,)] == [0, 1, 2, 3]
    TreeConfig(static_paths=paths)  # validates parents exist


def test_static_paths_need_parents():
    import pytest

    with pytest.raises(ValueError, match="lacks its parent"):
        TreeConfig(static_paths=((0,), (1, 0)))
