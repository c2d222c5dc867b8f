"""Compact sets of prompt ids: 8 bytes a prompt in numpy, not a Python string a prompt.

A job of 10^7 prompts must not keep 10^7 Python strings in its driver (~100 bytes each in a
list, ~150 in a set). The driver names a prompt by a 64-bit hash of its id instead:

    id_hashes(ids, salt)      uint64 per id, vectorized over the Arrow string buffers
    IdSet(sorted hashes)      membership and positions by binary search (np.searchsorted)

A hash names a prompt exactly because the prompt input's validation picks a `salt` under
which every id of the input hashes differently (pipeline.prompts: two ids with one hash are
compared as strings: equal, a duplicate id, refused; not, a collision, and the next salt is
tried: ~3e-6 of the time at 10^7 ids). Every id the job meets
(rows coming back, the prompt read again for a redo pass) is an input id, so under that salt
a hash in the set is that id and no other.

Both the driver (the row sink's seen-set, the redo passes) and the Ray Data tasks that
filter the prompt read (`keep_hashes`) use it; this module imports only numpy and pyarrow,
so a fresh task worker loads it in milliseconds.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import pyarrow as pa

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 1 << 20  # ids hashed at a time (bounds the transient arrays)
MAX_SALT_TRIES = 16

Ids = Union[pa.Array, pa.ChunkedArray]


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place (spreads the bits of the FNV state)."""
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return h


def _hash_chunk(arr: pa.Array, salt: int) -> np.ndarray:
    """FNV-1a over each id's UTF-8 bytes (seeded by `salt`), then mixed with its length.
    Works in length order so that every step is a contiguous slice: cost ~ the bytes."""
    n = len(arr)
    if arr.null_count:
        raise ValueError("prompt ids must not be null")
    arr = arr.cast(pa.large_binary())
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64, count=arr.offset + n + 1)[arr.offset:]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # longest first: the ids still going are a prefix
    starts, by_len = offsets[:-1][order], lengths[order]
    seed = _FNV_OFFSET ^ (np.uint64(salt) * _GOLDEN)
    h = np.full(n, seed, dtype=np.uint64)
    neg = -by_len
    for j in range(int(by_len[0]) if n else 0):
        k = int(np.searchsorted(neg, -j, side="left"))  # ids longer than j bytes
        h[:k] ^= data[starts[:k] + j].astype(np.uint64)
        h[:k] *= _FNV_PRIME
    h ^= by_len.astype(np.uint64) * _GOLDEN
    out = np.empty(n, dtype=np.uint64)
    out[order] = _mix(h)
    return out


def id_hashes(ids: Ids, salt: int = 0) -> np.ndarray:
    """One uint64 per id, in order."""
    chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
    parts = [_hash_chunk(c.slice(s, _CHUNK), salt) for c in chunks for s in range(0, len(c), _CHUNK)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


class IdSet:
    """A set of prompt ids as their sorted unique hashes under one salt, with a `seen` mark per
    member (the row sink's: which prompts have a row in this run)."""

    def __init__(self, hashes: np.ndarray, salt: int):
        self.hashes = np.unique(np.asarray(hashes, dtype=np.uint64))
        self.salt = salt
        self.seen = np.zeros(len(self.hashes), dtype=bool)

    def __len__(self) -> int:
        return len(self.hashes)

    def positions(self, hashes: np.ndarray) -> np.ndarray:
        """Each hash's index in the set, -1 where it is not a member."""
        if not len(self.hashes):
            return np.full(len(hashes), -1, dtype=np.int64)
        pos = np.searchsorted(self.hashes, hashes)
        pos = np.minimum(pos, len(self.hashes) - 1)
        return np.where(self.hashes[pos] == hashes, pos, -1).astype(np.int64)

    def contains(self, ids: Ids) -> np.ndarray:
        return self.positions(id_hashes(ids, self.salt)) >= 0

    def take_first(self, ids: Ids) -> np.ndarray:
        """Mark these ids seen; True for each row that is the first of its id (in this set and
        not seen before, nor earlier in `ids`)."""
        pos = self.positions(id_hashes(ids, self.salt))
        first = np.zeros(len(pos), dtype=bool)
        member = np.flatnonzero(pos >= 0)
        _, at = np.unique(pos[member], return_index=True)  # the first row of each position
        cand = member[at]
        new = cand[~self.seen[pos[cand]]]
        first[new] = True
        self.seen[pos[new]] = True
        return first

    @property
    def seen_count(self) -> int:
        return int(self.seen.sum())

    def missing(self) -> "IdSet":
        """The members not seen, as a new set (nothing seen yet)."""
        return IdSet(self.hashes[~self.seen], self.salt)


def keep_hashes(batch: pa.Table, hashes: Optional[np.ndarray], salt: int) -> pa.Table:
    """The rows of `batch` whose prompt_id hashes into `hashes` (sorted; None: every row): the
    prompt read's filter, run in Ray Data tasks."""
    if batch.num_rows == 0 or hashes is None:
        return batch
    h = id_hashes(batch["prompt_id"], salt)
    pos = np.minimum(np.searchsorted(hashes, h), max(len(hashes) - 1, 0))
    mask = hashes[pos] == h if len(hashes) else np.zeros(len(h), dtype=bool)
    return batch.filter(pa.array(mask))
