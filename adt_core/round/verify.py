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

Coupled (sampler "coupled", temperature > 0): the same walk as greedy with y(node) the
perturbed argmax of the warped logits plus the node position's fixed Gumbel noise (see
adt_core/round/noise.py); the output equals coupled AR sampling token for token.

Stochastic (sampler "rejection"): multi-draft recursive rejection over the children of the
current node, best draft score first: accept child x with probability p(x); on rejection set p(x) = 0 and renormalise;
when every child is rejected (or there are none) draw the bonus token from what is left. The
committed tokens are distributed exactly as sampling from p one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adt_core.config import SamplingConfig
from adt_core.round.sampling import perturbed, target_probs
from adt_core.round.state import TreeBatch, Verified


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


@dataclass(frozen=True)
class Relaxation:
    """LANTERN relaxed acceptance (lossy; see adt_core/round/lantern.py and docs/adt_tree.md).

    For a draft token x, A(x) is the longest prefix of x's codebook neighbours (nearest first)
    whose mass under the current p stays within a limit: delta (LANTERN; for later children of
    the same node the limit shrinks so that the whole node moves at most delta of mass) or
    (lam - 1) p(x) (LANTERN++). x is accepted with probability min(1, p(x) + p(A(x))).
    """

    neighbours: torch.Tensor  # (V, k) long, codes by codebook distance, self excluded
    delta: float = 0.0
    lam: float | None = None

    def prefix(self, p: torch.Tensor, x: int, limit: float) -> tuple[float, torch.Tensor]:
        """Mass of A(x) under p (V,) for a limit, and A(x) itself (codes)."""
        nb = self.neighbours[x].to(p.device)  # (k,)
        cum = p[nb].cumsum(0)  # (k,)
        n = int((cum <= limit + 1e-12).int().cumprod(0).sum())
        return (float(cum[n - 1]) if n else 0.0), nb[:n]


def node_acceptance(
    p: torch.Tensor, child_tokens: list[int], relax: Relaxation | None = None
) -> tuple[list[float], torch.Tensor]:
    """Acceptance probability of each child, tried in order, and the residual distribution.

    p: (V,) target distribution at the node. Child i is reached only when children 0..i-1 were
    rejected, so its probability is fixed in advance: a_i = p_i(x_i) (+ relaxed mass), where p_i
    is p with the earlier children removed and renormalised. The residual (V,) is p with every
    child removed, renormalised: the bonus token is drawn from it when all are rejected.
    """
    accept: list[float] = []
    live = p.clone()
    reach, used = 1.0, 0.0  # probability of reaching this child; relaxed mass spent (absolute)
    for x in child_tokens:
        z = float(live.sum())
        if z <= 0.0:
            accept.append(0.0)
            continue
        pi = live / z  # (V,)
        a = float(pi[x])
        if relax is not None:
            if relax.lam is not None:
                limit = (relax.lam - 1.0) * a
            else:
                limit = min(relax.delta, (relax.delta - used) / reach) if reach > 0 else 0.0
            mass, _ = relax.prefix(pi, x, max(limit, 0.0))
            a = min(1.0, a + mass)
            used += reach * mass
        accept.append(a)
        reach *= 1.0 - a
        live[x] = 0.0
    z = live.sum()
    residual = live / z if float(z) > 0 else p
    return accept, residual


def relaxed_sets(p: torch.Tensor, child_tokens: list[int], relax: Relaxation) -> list[torch.Tensor]:
    """A(x) for each child x of one node under coupled or greedy verification, children in order.

    delta mode: the limits shrink so the sets' total mass under p stays within delta (each later
    child gets what the earlier ones left); lam mode (LANTERN++): each child's limit is
    (lam - 1) p(x). Every token a relaxed acceptance moves lies in one of these sets, so the
    committed token's distribution is within total variation sum_x p(A(x)) <= delta of p.
    """
    sets, used = [], 0.0
    for x in child_tokens:
        limit = (relax.lam - 1.0) * float(p[x]) if relax.lam is not None else relax.delta - used
        mass, near = relax.prefix(p, x, max(limit, 0.0))
        used += mass
        sets.append(near)
    return sets


def follow_targets(tree: TreeBatch, b: int, targets: list[int], relax: Relaxation | None = None,
                   probs_at=None) -> VerifyResult:
    """Walk slot b's tree from the root along the child carrying the target's token y(node) at each node.

    targets: (n+1,) y(node) for every valid node (greedy: argmax; coupled: perturbed argmax).
    With `relax` (LANTERN, lossy), when no child carries y(node), the first child x whose
    A(x) (`relaxed_sets` under probs_at(node), a (V,) distribution) holds y(node) is accepted.
    The bonus token is y at the last accepted node.
    """
    tokens = tree.host().tokens[b]
    kids = tree.children(b)
    node, accepted = 0, []
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == targets[node]), None)
        if nxt is None and relax is not None and kids[node]:
            sets = relaxed_sets(probs_at(node), [tokens[c] for c in kids[node]], relax)
            nxt = next((c for c, a in zip(kids[node], sets) if bool((a == targets[node]).any())), None)
        if nxt is None:
            return VerifyResult(accepted, targets[node])
        accepted.append(nxt)
        node = nxt


def verify_greedy(tree: TreeBatch, b: int, logits: torch.Tensor, relax: Relaxation | None = None) -> VerifyResult:
    """Slot b's tree; logits: (n+1, V) CFG-mixed target logits at its valid nodes; y(node) = argmax.

    With `relax`, A(x) is measured under the un-warped softmax of the logits (LANTERN, greedy form).
    """
    return follow_targets(tree, b, logits.argmax(-1).tolist(), relax, lambda n: logits[n].float().softmax(-1))


def verify_coupled(tree: TreeBatch, b: int, logits: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig,
                   relax: Relaxation | None = None) -> VerifyResult:
    """Coupled verification of slot b's tree. logits: (n+1, V) CFG-mixed target logits at its valid
    nodes; noise: (n+1, V) the Gumbel
    row of each node's position (nodes at one depth share a row).

    y(node) = argmax(warped logits + noise): the token AR would sample there with the same seed,
    so the committed tokens equal coupled AR output token for token. With `relax`, A(x) is
    measured under p (the warped target distribution) at the node.
    """
    targets = perturbed(logits, sampling, noise).argmax(-1).tolist()
    return follow_targets(tree, b, targets, relax, lambda n: target_probs(logits[n], sampling))


def verify_stochastic(
    tree: TreeBatch,
    b: int,
    logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    relax: Relaxation | None = None,
) -> VerifyResult:
    """Slot b's tree; logits: (n+1, V) CFG-mixed target logits at its valid nodes; p is computed
    only at nodes on the walk."""
    tokens = tree.host().tokens[b]
    kids = tree.children(b)
    node, accepted = 0, []
    while True:
        p = target_probs(logits[node], sampling)  # (V,)
        accept, residual = node_acceptance(p, [tokens[c] for c in kids[node]], relax)
        nxt = None
        for c, a in zip(kids[node], accept):
            if float(torch.rand((), generator=generator, device=p.device)) < a:
                nxt = c
                break
        if nxt is None:
            return VerifyResult(accepted, int(torch.multinomial(residual, 1, generator=generator)))
        accepted.append(nxt)
        node = nxt


def follow_batch(tree: TreeBatch, targets: torch.Tensor, levels: int) -> Verified:
    """Greedy / coupled verification of every slot at once (the walk of `follow_targets`).

    tree: TreeBatch (C, n); targets: (C, n) y(node) at every node; levels: D, the deepest a tree
    can be. A node is on the accepted path when it and each of its ancestors carry the target's
    token at their parent (siblings carry distinct tokens, so the path is one chain). Returns
    Verified: accepted counts (C,), path (C, D + 1) tree indices of root + accepted nodes, new
    (C, D + 1) accepted tokens then the bonus token y(last accepted node); padded past each
    slot's count (accepted + 1)."""
    c, n = tree.tokens.shape
    dev = tree.tokens.device
    ok = tree.valid & (tree.tokens == targets.gather(1, tree.parents.clamp(min=0)))
    ok[:, 0] = True
    on_path = ~(tree.mask & ~ok[:, None, :]).any(-1)  # (C, n)
    depth = torch.where(on_path, tree.depths, -1)
    accepted = depth.max(1).values  # (C,)
    last = depth.argmax(1)
    bonus = targets.gather(1, last[:, None])  # (C, 1)
    path = torch.zeros(c, levels + 2, dtype=torch.long, device=dev)  # column D + 1: sink
    path.scatter_(1, torch.where(on_path, tree.depths, levels + 1), torch.arange(n, device=dev).expand(c, n))
    path = path[:, : levels + 1]
    new = torch.cat([tree.tokens.gather(1, path[:, 1:]), bonus], 1)  # (C, D + 1)
    new.scatter_(1, accepted[:, None], bonus)
    return Verified(accepted, path, new)
