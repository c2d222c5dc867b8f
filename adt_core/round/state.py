"""The typed state of one decoding round over every slot (image in flight).

C = slots (the engine's capacity), R = C x cfg rows (cond rows, then uncond rows), N = image
tokens per image, V = vocabulary. Device tensors carry whole-batch work; the host keeps what the
round's plan needs (counts, shapes), updated from the ONE read per round (`RoundOutcome`).

Vocabulary: the ROOT of a slot's tree is its last committed token (image index n - 1, not yet in
the target's cache); drafted nodes hang below it; a round commits the accepted drafted tokens
plus one bonus token (see adt_core/round/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Slots:
    """Every slot's committed tokens; free slots have count 0."""

    tokens: torch.Tensor  # (C, N + 1) long, device: committed tokens; column N is a write sink
    count: torch.Tensor  # (C,) long, device: committed tokens per slot
    keys: torch.Tensor  # (C,) long, device: each image's seed as its coupled-noise key (noise.seed_keys)
    host_count: np.ndarray  # (C,) int64: the same counts on the host
    active: np.ndarray  # (C,) bool: slot holds an image
    gens: list[torch.Generator | None]  # per slot: the rejection sampler's randomness
    held: bool = False  # free slots wait for the rest of their wave (`SlotTable.admits_now`): a plain step
    room: int = 1 << 30  # drafted nodes this round's verify may carry per row: the target cache's room past
    # its longest row (the decoder's, each round; less than the widest tree only near an image's end)

    @classmethod
    def empty(cls, capacity: int, n_tokens: int, device: torch.device) -> "Slots":
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(capacity, n_tokens + 1), z(capacity), z(capacity), np.zeros(capacity, np.int64),
                   np.zeros(capacity, bool), [None] * capacity)

    @property
    def capacity(self) -> int:
        return self.count.numel()

    @property
    def sink(self) -> int:
        return self.tokens.shape[1] - 1

    def narrow(self, order: np.ndarray) -> None:
        """Keep slots `order` (n,) as slots 0 .. n - 1 (BatchDecoder.narrow)."""
        idx = torch.from_numpy(np.asarray(order, dtype=np.int64)).to(self.count.device)
        self.tokens, self.count, self.keys = (x.index_select(0, idx) for x in (self.tokens, self.count, self.keys))
        self.host_count, self.active = self.host_count[order], self.active[order]
        self.gens = [self.gens[i] for i in order]

    def roots(self) -> torch.Tensor:
        """(C,) each slot's last committed token (free slots: token 0)."""
        return self.tokens.gather(1, (self.count - 1).clamp(min=0)[:, None])[:, 0]

    def write(self, new: torch.Tensor, counts: torch.Tensor, host_counts: np.ndarray) -> None:
        """Commit new (C, P) tokens: slot b takes new[b, :counts[b]] after its committed ones."""
        j = torch.arange(new.shape[1], device=new.device)
        cols = torch.where(j < counts[:, None], self.count[:, None] + j, self.sink)  # (C, P)
        self.tokens.scatter_(1, cols, new)
        self.count += counts
        self.host_count += host_counts


@dataclass(frozen=True)
class RoundPlan:
    """What a speculative round builds, decided on the host before it starts."""

    levels: int  # D: draft levels run (>= 1)
    width: int  # K: children per expansion and frontier size (dynamic trees)
    nodes: int  # M: drafted nodes kept per slot; the verify forward carries 1 + M per row
    depth: np.ndarray  # (C,) int: levels slot b may use (0: it drafts nothing this round)
    widths: np.ndarray  # (C,) int: children slot b may use per expansion
    budget: np.ndarray  # (C,) int: drafted nodes slot b may keep (<= M)


@dataclass(frozen=True)
class Extent:
    """Cache entries a method's rounds need past a row's committed sequence (its planner's
    `extent`: the decoder sizes its caches by it, adt_core/memory.py plans memory by it)."""

    nodes: int  # drafted nodes of the widest verified tree per slot (0: the method never drafts)
    fed: int  # drafter-cache entries one round may feed (0: no drafter)
    room: int | None = None  # tree nodes a target-cache row holds past an image's last entry (None:
    # `nodes`); a planner with less room plans within what the rows leave (`Slots.room`)

    def target_len(self, committed: int) -> int:
        """A target-cache row: `committed` entries (prompt + generated), the root and the tree's
        room, one spare."""
        return committed + (self.nodes if self.room is None else self.room) + 2

    def drafter_len(self, committed: int) -> int:
        """A drafter-cache row: `committed` entries, what one round feeds, one spare."""
        return committed + self.fed + 1


@dataclass
class CandidateBatch:
    """Every slot's drafted candidates (the pool EAGLE-2 reranks), P per slot, padded."""

    tokens: torch.Tensor  # (C, P) long
    parents: torch.Tensor  # (C, P) long: pool index of the parent, -1 = the root
    depths: torch.Tensor  # (C, P) long: 1 = child of the root
    scores: torch.Tensor  # (C, P) float: cumulative path score (log confidence)
    valid: torch.Tensor  # (C, P) bool: a real candidate (padding, masked ranks and levels: False)


@dataclass
class TreeBatch:
    """Every slot's draft tree, node 0 the root, valid nodes first in breadth-first order."""

    tokens: torch.Tensor  # (C, 1 + M) long
    parents: torch.Tensor  # (C, 1 + M) long: tree index of the parent, -1 for the root and padding
    depths: torch.Tensor  # (C, 1 + M) long: 0 = the root
    scores: torch.Tensor  # (C, 1 + M) float: path scores (root 0)
    valid: torch.Tensor  # (C, 1 + M) bool: root and kept nodes
    mask: torch.Tensor  # (C, 1 + M, 1 + M) bool: [b, i, j] = j is i or an ancestor of i (padding: itself)
    _host: "HostTree | None" = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def host(self) -> "HostTree":
        """Every slot's tree on the host, read once per round (the slot-by-slot verifiers walk it)."""
        if self._host is None:
            self._host = HostTree(self.valid.sum(1).tolist(), self.tokens.tolist(), self.parents.tolist(),
                                  self.depths.tolist(), self.scores.tolist())
        return self._host

    def kept(self, b: int) -> int:
        """Slot b's valid nodes (root + kept nodes; they come first)."""
        return self.host().kept[b]

    def children(self, b: int) -> list[list[int]]:
        """Slot b's tree: children[i] = the valid nodes below node i, best path score first."""
        h, n = self.host(), self.kept(b)
        par, sc = h.parents[b][:n], h.scores[b][:n]
        kids: list[list[int]] = [[] for _ in par]
        for i, p in enumerate(par):
            if p >= 0:
                kids[p].append(i)
        for k in kids:
            k.sort(key=lambda i: -sc[i])
        return kids


@dataclass(frozen=True)
class HostTree:
    """A TreeBatch's rows as host lists: [b][i] of slot b's node i."""

    kept: list[int]  # (C,) valid nodes per slot
    tokens: list[list[int]]
    parents: list[list[int]]
    depths: list[list[int]]
    scores: list[list[float]]


@dataclass
class Verified:
    """The accepted path and the commit of every slot (device)."""

    accepted: torch.Tensor  # (C,) long: accepted drafted tokens (0 for slots that drafted nothing)
    path: torch.Tensor  # (C, D + 1) long: tree indices of root + accepted nodes, padded
    new: torch.Tensor  # (C, D + 1) long: accepted tokens then the bonus token, padded


@dataclass(frozen=True)
class RoundOutcome:
    """What the host reads back once per speculative round."""

    accepted: np.ndarray  # (C,) accepted drafted tokens
    depth: np.ndarray  # (C,) depth of the kept tree
    nodes: np.ndarray  # (C,) drafted nodes verified
    # level_conf and curve are read back only for a planner that reads_curves (else empty)
    level_conf: np.ndarray  # (D + 1,) summed path confidence of kept nodes per depth (all slots)
    curve: np.ndarray  # (D, n_max + 1): [j - 1, m] summed confidence of each slot's m best candidates of depth <= j


@dataclass
class Forecasts:
    """A cost planner's model checked out of sample: for each drafted round it sized, the tokens and
    ms the model expected of the plan (made in `plan`, before the round ran) against what the round
    committed and cost on the planner's clock (`observe`). Rounds whose depth the model had not
    learned (a level tried past the deepest) and each kind's first, warm-up round are not counted."""

    rounds: int = 0
    tokens_expected: float = 0.0
    tokens_committed: float = 0.0
    ms_expected: float = 0.0
    ms_measured: float = 0.0

    def add(self, expected: tuple[float, float], tokens: float, ms: float) -> None:
        self.rounds += 1
        self.tokens_expected += expected[0]
        self.ms_expected += expected[1]
        self.tokens_committed += tokens
        self.ms_measured += ms

    def as_dict(self) -> dict:
        """The sums, and committed / expected tokens and measured / expected ms (None before a round)."""
        ratio = lambda a, b: a / b if self.rounds and b > 0 else None  # noqa: E731
        return {"rounds": self.rounds, "tokens_expected": self.tokens_expected, "tokens_committed": self.tokens_committed,
                "ms_expected": self.ms_expected, "ms_measured": self.ms_measured,
                "tokens_ratio": ratio(self.tokens_committed, self.tokens_expected),
                "ms_ratio": ratio(self.ms_measured, self.ms_expected)}
