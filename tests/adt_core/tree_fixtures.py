"""Hand-built draft trees for the verifier tests: one slot's tree as a TreeBatch (the one tree type)."""

import torch

from adt_core.round.state import TreeBatch
from adt_core.round.tree import ancestor_mask_batch


def one_tree(tokens: list[int], parents: list[int], depths: list[int], scores: list[float]) -> TreeBatch:
    """Slot 0 of a C = 1 TreeBatch: node 0 the root (parent -1), every node valid."""
    par = torch.tensor([parents])
    return TreeBatch(torch.tensor([tokens]), par, torch.tensor([depths]), torch.tensor([scores]),
                     torch.ones(1, len(tokens), dtype=torch.bool), ancestor_mask_batch(par, max(depths)))


def chain_tree() -> TreeBatch:
    """root(0) -> 1 (tok 3) -> 3 (tok 4);  root -> 2 (tok 5)."""
    return one_tree([9, 3, 5, 4], [-1, 0, 0, 1], [0, 1, 1, 2], [0.0, -0.1, -0.2, -0.3])
