"""Draft-tree topology: every slot's tree built from its drafted candidates (whole-batch).

A draft tree hangs below the ROOT, the last committed token (not yet in the target's cache).
Node 0 is the root; nodes 1..n are drafted tokens in breadth-first order (a parent always has
a smaller index than its children). A node at depth j from a root at sequence position t sits
at position t + j (the 2-D RoPE then gives it the grid cell of that raster index).

Candidate pools (state.CandidateBatch) come from the drafter's expansions: every drafted child
with its parent's pool index (-1 = the root), its depth and its cumulative draft log-probability
(EAGLE-2's path confidence, in log space); `rerank_batch` keeps each slot's best as a
state.TreeBatch, the one tree type (the slot-by-slot verifiers read its rows: TreeBatch.children).
"""

from __future__ import annotations

import torch

from adt_core.round.state import CandidateBatch, TreeBatch


def static_children(paths: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], list[int]]:
    """Static tree shape -> {path of a node: sorted child ranks} (the root is the empty path)."""
    out: dict[tuple[int, ...], list[int]] = {}
    for p in sorted(paths, key=len):
        out.setdefault(p[:-1], []).append(p[-1])
    return {k: sorted(v) for k, v in out.items()}


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


def rerank_batch(pool: CandidateBatch, nodes: int, budget: torch.Tensor, roots: torch.Tensor,
                 levels: int) -> TreeBatch:
    """Every slot keeps its best candidates by path score as a tree (EAGLE-2 reranking, batched).

    pool: CandidateBatch (C, P); nodes: M, the kept width; budget (C,): nodes slot b may keep
    (<= M); roots (C,) root tokens. Scores never increase along a path and ties go to the
    shallower node, so each slot's kept set is closed under ancestors; kept nodes are ordered
    breadth-first (parents first), invalid ones last. Returns a TreeBatch (C, 1 + M)."""
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
