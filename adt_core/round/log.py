"""Per-image statistics, kept as whole-batch arrays: one append per round, not per slot.

Counters are (C,) numpy arrays indexed by slot; a drafted round's trace is one (A, F) array over
the A slots in it. A plain round is the same for every image in flight, so it is two running
sums and (traced) one row: an image's plain rounds are those since it entered. When an image
leaves, its `StepStats` is assembled from the counters and the rounds since it entered
(results.py defines the fields and their meaning).
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from adt_core.results import RoundTraces, StepStats

FIELDS = ("round", "serial", "position", "depth", "width", "nodes", "accepted", "draft_ms", "verify_ms", "slots",
          "tokens")
INTS = [2, 3, 4, 5, 6, 9, 10]  # position, depth, width, nodes, accepted, slots, tokens (RoundTrace's int fields)
COUNTERS = ("target_forwards", "draft_forwards", "draft_tokens", "accepted_draft_tokens", "draft_ms", "verify_ms",
            "total_ms")


class PlainRounds:
    """One row per plain round, (round number, ms per image, slots, tokens): every image in flight
    took part in it, so rows are not per slot. Rows are appended as tuples and made an array only
    for an image that leaves (written into a numpy array, a row cost ~8 us a round: 0.2% of a
    plain step of 4 emoji16 images on a CPU, which `ar` does not pay)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, int, int]] = []

    def append(self, round_no: int, ms: float, a: int, tokens: int) -> None:
        self.rows.append((round_no, ms, a, tokens))

    def since(self, round_no: int) -> np.ndarray:
        i = bisect.bisect_left(self.rows, round_no, key=_first)
        return np.array(self.rows[i:], dtype=np.float64).reshape(-1, 4)

    def drop_before(self, round_no: int) -> None:
        del self.rows[: bisect.bisect_left(self.rows, round_no, key=_first)]


def _first(row: tuple) -> int:
    return row[0]


class RoundLog:
    def __init__(self, capacity: int, traced: bool, lossy: bool, sampler: str, model_drafts: bool = True) -> None:
        self.traced, self.lossy, self.sampler, self.capacity = traced, lossy, sampler, capacity
        self.model_drafts = model_drafts  # False: a draft level runs no model (jacobi), no draft forwards
        self.serial = np.full(capacity, -1, np.int64)  # the image in each slot
        self.entered = np.zeros(capacity, np.int64)  # round number at which it entered
        self.count = {k: np.zeros(capacity) for k in COUNTERS}
        self.rounds: deque[np.ndarray] = deque()  # drafted rounds: (A, F) trace rows, column 0 the round number
        self.plain = PlainRounds()  # plain rounds' trace rows
        self.plain_n, self.plain_ms = 0, 0.0  # plain rounds so far, and the sum of their ms per image
        self.snap = np.zeros((capacity, 2))  # (plain_n, plain_ms) when each slot's image entered
        self.round_no = 0
        self._next_serial = 0
        self._joined: tuple[int, np.ndarray] | None = None  # (round number, every kept drafted-round row)

    def narrow(self, order: np.ndarray) -> None:
        """Keep slots `order` (n,) as slots 0 .. n - 1 (BatchDecoder.narrow); rounds stay as logged."""
        self.serial, self.entered, self.snap = self.serial[order], self.entered[order], self.snap[order]
        self.count = {k: v[order] for k, v in self.count.items()}
        self.capacity = len(order)

    def admit(self, slots: np.ndarray, share_ms: float) -> None:
        """Images enter `slots` (indices); the prefill's time is shared among them."""
        self.serial[slots] = np.arange(self._next_serial, self._next_serial + len(slots))
        self._next_serial += len(slots)
        self.entered[slots] = self.round_no
        self.snap[slots] = (self.plain_n, self.plain_ms)
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
        if depth is None and not draft_ms:  # a plain step: every image in flight is in it, nothing per slot
            ms = verify_ms / a
            self.plain_n += 1
            self.plain_ms += ms
            if self.traced:
                self.plain.append(self.round_no, ms, a, tokens or a)
            self.round_no += 1
            return
        z = np.zeros(self.capacity)
        depth, width, nodes, accepted = (z if x is None else x for x in (depth, width, nodes, accepted))
        d_ms, v_ms = draft_ms / a, verify_ms / a
        c = self.count
        c["target_forwards"][active] += 1
        c["draft_forwards"][active & (depth > 0)] += max(levels, 1) if self.model_drafts else 0
        c["draft_tokens"][active] += nodes[active]
        c["accepted_draft_tokens"][active] += accepted[active]
        c["draft_ms"][active] += d_ms
        c["verify_ms"][active] += v_ms
        c["total_ms"][active] += d_ms + v_ms
        if self.traced:
            full = lambda v: np.full(self.capacity, v)  # noqa: E731
            cols = (full(self.round_no), self.serial, position, depth, width, nodes, accepted, full(d_ms), full(v_ms),
                    full(a), full(tokens or a))
            self.rounds.append(np.stack([np.asarray(x, np.float64)[active] for x in cols], 1))
        self.round_no += 1

    def finish(self, b: int, batch_size: int) -> StepStats:
        """Slot b's image is done: its statistics (its plain rounds: every plain round since it
        entered)."""
        c = {k: v[b] for k, v in self.count.items()}
        plain_n, plain_ms = self.plain_n - self.snap[b, 0], self.plain_ms - self.snap[b, 1]
        stats = StepStats(
            target_forwards=int(c["target_forwards"] + plain_n), draft_forwards=int(c["draft_forwards"]),
            draft_tokens=int(c["draft_tokens"]), accepted_draft_tokens=int(c["accepted_draft_tokens"]),
            draft_ms=float(c["draft_ms"]), verify_ms=float(c["verify_ms"] + plain_ms),
            total_ms=float(c["total_ms"] + plain_ms), plain_rounds=int(plain_n), plain_ms=float(plain_ms),
            batch_size=batch_size, lossy=self.lossy, sampler=self.sampler,
        )
        if self.traced:
            rows = self._rows(b)
            ints = rows[:, INTS].astype(np.int64)
            stats.accepted_lengths = ints[:, 4].tolist()
            stats.rounds = RoundTraces(ints, rows[:, 7:9].copy())
        self.serial[b] = -1
        self._prune()
        return stats

    def _rows(self, b: int) -> np.ndarray:
        """Slot b's trace rows (R, F) in round order: its drafted rounds' own rows and a row per
        plain round since it entered, positions filled in (each round advances an image by its
        accepted tokens + 1; the first starts at the admitted token, position 1)."""
        every = self._all_rows()
        mine = every[every[:, 1] == self.serial[b]]  # serials are unique: only this image's rounds
        plain = self.plain.since(int(self.entered[b]))
        rows = np.zeros((len(mine) + len(plain), len(FIELDS)))
        rows[: len(mine)] = mine
        p = rows[len(mine) :]
        p[:, 0], p[:, 1], p[:, 8], p[:, 9], p[:, 10] = plain[:, 0], self.serial[b], plain[:, 1], plain[:, 2], plain[:, 3]
        rows = rows[np.argsort(rows[:, 0], kind="stable")]
        advance = rows[:, 6] + 1
        rows[:, 2] = 1 + np.concatenate([[0.0], np.cumsum(advance)[:-1]])
        return rows

    def _all_rows(self) -> np.ndarray:
        """Every kept drafted round's trace rows in one array, built once per round number
        (images that finish in the same round share it)."""
        if self._joined is None or self._joined[0] != self.round_no:
            rows = list(self.rounds)
            self._joined = (self.round_no, np.concatenate(rows) if rows else np.zeros((0, len(FIELDS))))
        return self._joined[1]

    def _prune(self) -> None:
        """Drop rounds older than every image still in flight."""
        live = self.entered[self.serial >= 0]
        oldest = int(live.min()) if live.size else self.round_no
        while self.rounds and self.rounds[0][0, 0] < oldest:
            self.rounds.popleft()
        self.plain.drop_before(oldest)
