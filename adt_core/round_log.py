"""Per-image statistics, kept as whole-batch arrays: one append per round, not per slot.

Counters are (C,) numpy arrays indexed by slot; round traces are one (A, F) array per round over
the A slots in it. When an image leaves, its `StepStats` is assembled from the counters and
the rounds since it entered (results.py defines the fields and their meaning).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from adt_core.results import RoundTrace, StepStats

FIELDS = ("serial", "position", "depth", "width", "nodes", "accepted", "draft_ms", "verify_ms", "slots", "tokens")
INTS = [1, 2, 3, 4, 5, 8, 9]  # position, depth, width, nodes, accepted, slots, tokens (RoundTrace's int fields)
COUNTERS = ("target_forwards", "draft_forwards", "draft_tokens", "accepted_draft_tokens", "draft_ms", "verify_ms",
            "total_ms")


class RoundLog:
    def __init__(self, capacity: int, traced: bool, lossy: bool, sampler: str) -> None:
        self.traced, self.lossy, self.sampler, self.capacity = traced, lossy, sampler, capacity
        self.serial = np.full(capacity, -1, np.int64)  # the image in each slot
        self.entered = np.zeros(capacity, np.int64)  # round number at which it entered
        self.count = {k: np.zeros(capacity) for k in COUNTERS}
        self.rounds: deque[tuple[int, np.ndarray]] = deque()  # (round number, (A, F) trace rows)
        self.round_no = 0
        self._next_serial = 0
        self._joined: tuple[int, np.ndarray] | None = None  # (round number, every kept trace row)

    def admit(self, slots: np.ndarray, share_ms: float) -> None:
        """Images enter `slots` (indices); the prefill's time is shared among them."""
        self.serial[slots] = np.arange(self._next_serial, self._next_serial + len(slots))
        self._next_serial += len(slots)
        self.entered[slots] = self.round_no
        for k in COUNTERS:
            self.count[k][slots] = 0.0
        self.count["target_forwards"][slots] = 1
        self.count["total_ms"][slots] = share_ms
        self.count["verify_ms"][slots] = share_ms

    def add(self, active: np.ndarray, position: np.ndarray, draft_ms: float, verify_ms: float,
            depth: np.ndarray | None = None, width: np.ndarray | None = None, nodes: np.ndarray | None = None,
            accepted: np.ndarray | None = None, levels: int = 0, tokens: int = 0) -> None:
        """One round over the `active` (C,) slots; the per-slot arrays (C,) default to a plain
        step's (nothing drafted); times are the round's and are shared equally."""
        a = int(active.sum())
        if depth is None and not draft_ms:  # a plain step: only its time and one forward to count
            self._add_plain(active, position, verify_ms / a, a, tokens or a)
            return
        z = np.zeros(self.capacity)
        depth, width, nodes, accepted = (z if x is None else x for x in (depth, width, nodes, accepted))
        d_ms, v_ms = draft_ms / a, verify_ms / a
        c = self.count
        c["target_forwards"][active] += 1
        c["draft_forwards"][active & (depth > 0)] += max(levels, 1)
        c["draft_tokens"][active] += nodes[active]
        c["accepted_draft_tokens"][active] += accepted[active]
        c["draft_ms"][active] += d_ms
        c["verify_ms"][active] += v_ms
        c["total_ms"][active] += d_ms + v_ms
        if self.traced:
            cols = (self.serial, position, depth, width, nodes, accepted, np.full(self.capacity, d_ms),
                    np.full(self.capacity, v_ms), np.full(self.capacity, a), np.full(self.capacity, tokens or a))
            self.rounds.append((self.round_no, np.stack([np.asarray(x, np.float64)[active] for x in cols], 1)))
        self.round_no += 1

    def _add_plain(self, active: np.ndarray, position: np.ndarray, ms: float, a: int, tokens: int) -> None:
        """`add` for a round that drafted nothing (the same counters and trace row, fewer array ops:
        it runs every step of `ar` and of a speculative method's non-drafting rounds)."""
        c = self.count
        c["target_forwards"][active] += 1
        c["verify_ms"][active] += ms
        c["total_ms"][active] += ms
        if self.traced:
            rows = np.zeros((a, len(FIELDS)))
            rows[:, 0], rows[:, 1] = self.serial[active], position[active]
            rows[:, 7], rows[:, 8], rows[:, 9] = ms, a, tokens
            self.rounds.append((self.round_no, rows))
        self.round_no += 1

    def finish(self, b: int, batch_size: int) -> StepStats:
        """Slot b's image is done: its statistics."""
        c = {k: v[b] for k, v in self.count.items()}
        stats = StepStats(
            target_forwards=int(c["target_forwards"]), draft_forwards=int(c["draft_forwards"]),
            draft_tokens=int(c["draft_tokens"]), accepted_draft_tokens=int(c["accepted_draft_tokens"]),
            draft_ms=float(c["draft_ms"]), verify_ms=float(c["verify_ms"]), total_ms=float(c["total_ms"]),
            batch_size=batch_size, lossy=self.lossy, sampler=self.sampler,
        )
        if self.traced:
            every = self._all_rows()
            rows = every[every[:, 0] == self.serial[b]]  # serials are unique: only this image's rounds
            ints = rows[:, INTS].astype(np.int64).tolist()
            ms = rows[:, 6:8].tolist()
            stats.accepted_lengths = [r[4] for r in ints]
            stats.rounds = [RoundTrace(p, d, w, n, a, dm, vm, sl, tk)
                            for (p, d, w, n, a, sl, tk), (dm, vm) in zip(ints, ms)]
        self.serial[b] = -1
        self._prune()
        return stats

    def _all_rows(self) -> np.ndarray:
        """Every kept round's trace rows in one array, built once per round number (images that
        finish in the same round share it)."""
        if self._joined is None or self._joined[0] != self.round_no:
            rows = [r for _, r in self.rounds]
            self._joined = (self.round_no, np.concatenate(rows) if rows else np.zeros((0, len(FIELDS))))
        return self._joined[1]

    def _prune(self) -> None:
        """Drop rounds older than every image still in flight."""
        live = self.entered[self.serial >= 0]
        oldest = int(live.min()) if live.size else self.round_no
        while self.rounds and self.rounds[0][0] < oldest:
            self.rounds.popleft()
