"""Draft-tree topology: small pure helpers over candidate pools.

A draft tree hangs below the ROOT, the last committed token (not yet in the target's cache).
Node 0 is the root; nodes 1..n are drafted tokens in breadth-first order (a parent always has
a smaller index than its children). A node at depth j from a root at sequence position t sits
at position t + j (the 2-D RoPE then gives it the grid cell of that raster index).

Candidate pools come from the drafter's expansions: every drafted child with its parent's pool
index (-1 = the root), its depth and its cumulative draft log-probability (EAGLE-2's path
confidence, in log space).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CandidatePool:
    tokens: torch.Tensor  # (M,) long
    parents: torch.Tensor  # (M,) long, pool index of the parent, -1 = root
    depths: torch.Tensor  # (M,) long, 1 = child of the root
    scores: torch.Tensor  # (M,) float, cumulative draft log-probability


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (n+1,) long, tokens[0] = root token
    parents: torch.Tensor  # (n+1,) long, parents[0] = -1
    depths: torch.Tensor  # (n+1,) long, depths[0] = 0
    scores: torch.Tensor  # (n+1,) float, scores[0] = 0
    root_position: int

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    @property
    def positions(self) -> torch.Tensor:
        return self.root_position + self.depths  # (n+1,)

    def ancestor_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)

    def children(self) -> list[list[int]]:
        """children[i] = node indices below i, best draft score first."""
        return children_lists(self.parents, self.scores)

    def leaf_paths(self) -> list[list[int]]:
        return leaf_paths(self.parents)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents (N,) with parents[i] < i -> (N, N) bool: [i, j] = j is i or an ancestor of i."""
    par = parents.tolist()
    n = len(par)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        if par[i] >= 0:
            mask[i] |= mask[par[i]]
    return mask.to(parents.device)


def children_lists(parents: torch.Tensor, scores: torch.Tensor) -> list[list[int]]:
    par, sc = parents.tolist(), scores.tolist()
    kids: list[list[int]] = [[] for _ in par]
    for i, p in enumerate(par):
        if p >= 0:
            kids[p].append(i)
    for k in kids:
        k.sort(key=lambda i: -sc[i])
    return kids


def leaf_paths(parents: torch.Tensor) -> list[list[int]]:
    """Every root-to-leaf path as node indices (root excluded), leaves in index order."""
    par = parents.tolist()
    has_child = set(p for p in par if p >= 0)
    paths = []
    for leaf in range(1, len(par)):
        if leaf in has_child:
            continue
        path, i = [], leaf
        while i > 0:
            path.append(i)
            i = par[i]
        paths.append(path[::-1])
    return paths


def rerank(pool: CandidatePool, budget: int, root_token: int, root_position: int) -> DraftTree:
    """Keep the `budget` best candidates by path confidence as a tree (EAGLE-2 reranking).

    Cumulative log-probabilities never increase along a path, so ordering by (score desc,
    depth asc) puts every parent before its children: the kept set is closed under ancestors.
    """
    m = pool.tokens.numel()
    n = min(budget, m)
    key = pool.scores.double() - pool.depths.double() * 1e-9  # ties: shallower first
    keep = torch.topk(key, n).indices  # (n,)
    order = torch.argsort(pool.depths[keep] * (m + 1) + keep, stable=True)  # BFS order, then pool order
    keep = keep[order]
    remap = torch.full((m + 1,), -1, dtype=torch.long, device=keep.device)  # pool index -> tree index
    remap[keep] = torch.arange(1, n + 1, device=keep.device)
    parent_pool = pool.parents[keep]
    parents = torch.where(parent_pool < 0, torch.zeros_like(parent_pool), remap[parent_pool])
    if bool((parents < 0).any()):
        raise AssertionError("rerank dropped an ancestor of a kept node")
    dev = keep.device
    return DraftTree(
        tokens=torch.cat([torch.tensor([root_token], device=dev), pool.tokens[keep]]),
        parents=torch.cat([torch.tensor([-1], device=dev), parents]),
        depths=torch.cat([torch.zeros(1, dtype=torch.long, device=dev), pool.depths[keep]]),
        scores=torch.cat([torch.zeros(1, device=dev, dtype=pool.scores.dtype), pool.scores[keep]]),
        root_position=root_position,
    )


def static_children(paths: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], list[int]]:
    """Static tree shape -> {path of a node: sorted child ranks} (the root is the empty path)."""
    out: dict[tuple[int, ...], list[int]] = {}
    for p in sorted(paths, key=len):
        out.setdefault(p[:-1], []).append(p[-1])
    return {k: sorted(v) for k, v in out.items()}


# ---- whole-batch forms (every slot at once; see adt_core/round/state.py) -------------------
def ancestor_mask_batch(parents: torch.Tensor, levels: int) -> torch.Tensor:
    """parents (C, n) tree indices (-1: root or padding) -> (C, n, n) bool: [b, i, j] = j is i or
    an ancestor of i. One gather per level (trees at most `levels` deep); padding sees itself."""
    c, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    par = torch.where(parents >= 0, parents, idx)  # root and padding: themselves
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(c, n, n)
    gather_at = par[..., None].expand(c, n, n)
    for _ in range(levels):
        mask = mask | mask.gather(1, gather_at)
    return mask


def rerank_batch(pool, nodes: int, budget: torch.Tensor, roots: torch.Tensor, levels: int):
    """Every slot keeps its best candidates by path score as a tree (EAGLE-2 reranking, batched).

    pool: CandidateBatch (C, P); nodes: M, the kept width; budget (C,): nodes slot b may keep
    (<= M); roots (C,) root tokens. Scores never increase along a path and ties go to the
    shallower node, so each slot's kept set is closed under ancestors; kept nodes are ordered
    breadth-first (parents first), invalid ones last. Returns a TreeBatch (C, 1 + M)."""
    from adt_core.round.state import TreeBatch

    c, p = pool.tokens.shape
    dev = pool.tokens.device
    m = min(nodes, p)
    key = torch.where(pool.valid, pool.scores.double() - pool.depths.double() * 1e-9, float("-inf"))
    top = torch.topk(key, m, dim=1)  # sorted, best first
    ok = torch.isfinite(top.values) & (torch.arange(m, device=dev) < budget[:, None])  # (C, m)
    depth = pool.depths.gather(1, top.indices)
    order = torch.argsort(torch.where(ok, depth * (p + 1) + top.indices, 2 * (p + 1) ** 2), dim=1, stable=True)
    keep, ok, depth = top.indices.gather(1, order), ok.gather(1, order), depth.gather(1, order)  # (C, m)
    tree_idx = torch.arange(1, m + 1, device=dev).expand(c, m)
    inv = torch.full((c, p + 1), -1, dtype=torch.long, device=dev)  # pool index -> tree index; column p: sink
    inv.scatter_(1, torch.where(ok, keep, p), tree_idx)
    ppool = pool.parents.gather(1, keep)
    par = torch.where(ppool < 0, torch.zeros_like(ppool), inv.gather(1, ppool.clamp(min=0)))
    par = torch.where(ok, par, -1)
    col = lambda x: x[:, None]  # noqa: E731
    parents = torch.cat([torch.full((c, 1), -1, dtype=torch.long, device=dev), par], 1)
    return TreeBatch(
        tokens=torch.cat([col(roots), pool.tokens.gather(1, keep)], 1),
        parents=parents,
        depths=torch.cat([torch.zeros(c, 1, dtype=torch.long, device=dev), torch.where(ok, depth, 0)], 1),
        scores=torch.cat([torch.zeros(c, 1, device=dev), torch.where(ok, pool.scores.gather(1, keep), 0.0)], 1),
        valid=torch.cat([torch.ones(c, 1, dtype=torch.bool, device=dev), ok], 1),
        mask=ancestor_mask_batch(parents, levels),
    )


def tree_of(batch, b: int) -> DraftTree:
    """Slot b's tree of a TreeBatch as a DraftTree (its valid nodes; one host read)."""
    n = int(batch.valid[b].sum())
    return DraftTree(batch.tokens[b, :n], batch.parents[b, :n], batch.depths[b, :n], batch.scores[b, :n], 0)
