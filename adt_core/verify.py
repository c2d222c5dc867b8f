"""Tree verification: pure functions from target logits (and a generator) to a VerifyResult.

Vocabulary (used everywhere in the engine):
- p(. | node): the target's distribution for the token AFTER a tree node, from the target's
  CFG-mixed logits at that node, warped by temperature / top-k / top-p.
- q: the drafter's distribution. EAGLE-2 drafts are deterministic (top-k children), so
  verification never needs q, only the order in which children are tried.
- accepted tokens: drafted nodes on the accepted path, root excluded, in order.
- bonus token: one token drawn from p at the last accepted node (after excluding rejected
  children); every round commits accepted tokens + the bonus token.

Greedy (temperature 0): a child is accepted iff its token is the argmax of the target's logits
at its parent; the path followed is unique because siblings carry distinct tokens. The output
equals vanilla greedy decoding token for token.

Stochastic: multi-draft recursive rejection over the children of the current node, best draft
score first: accept child x with probability p(x); on rejection set p(x) = 0 and renormalise;
when every child is rejected (or there are none) draw the bonus token from what is left. The
committed tokens are distributed exactly as sampling from p one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adt_core.config import SamplingConfig
from adt_core.sampling import target_probs
from adt_core.tree import DraftTree


@dataclass
class VerifyResult:
    accepted: list[int]  # node indices of accepted drafted tokens along the path (root excluded)
    bonus: int  # token id drawn at the last accepted node

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    @property
    def last_node(self) -> int:
        return self.accepted[-1] if self.accepted else 0


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """logits: (n+1, V) CFG-mixed target logits at every tree node."""
    best = logits.argmax(-1).tolist()  # (n+1,)
    tokens = tree.tokens.tolist()
    kids = tree.children()
    node, accepted = 0, []
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return VerifyResult(accepted, best[node])
        accepted.append(nxt)
        node = nxt


def verify_stochastic(
    tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> VerifyResult:
    """logits: (n+1, V) CFG-mixed target logits; p is computed only at nodes on the walk."""
    tokens = tree.tokens.tolist()
    kids = tree.children()
    node, accepted = 0, []
    while True:
        p = target_probs(logits[node], sampling)  # (V,)
        nxt = None
        for c in kids[node]:
            x = tokens[c]
            px = float(p[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if u < px:
                nxt = c
                break
            p[x] = 0.0
            p = p / p.sum()
        if nxt is None:
            return VerifyResult(accepted, int(torch.multinomial(p, 1, generator=generator)))
        accepted.append(nxt)
        node = nxt
