"""Preallocated key/value cache with a length per row (ragged).

One cache serves one model (target or drafter) and a fixed set of rows. With classifier-free
guidance an image (a slot) owns two rows: slot b is row b (cond) and row slots + b (uncond).
A forward writes its S new entries of row r at [lengths[r], lengths[r] + S) in every layer
(`write`), then `advance(S)`. Rows differ in length after verification: `keep_rows` compacts
each row's root + accepted path in place, so a row always holds exactly its committed sequence
(memory per image: captions + image tokens + one tree, whatever the number of rounds).

Attention runs over keys [0, max row length + S); the mask hides, per row, the keys past its
own length, caption padding (`valid` False: LlamaGen masks padded caption keys for both CFG
rows) and whatever a tree mask hides. While every row has the same length (prefill, uniform
steps) writes are plain slices. Once drafted rounds have left rows at different lengths, a plain
step's one entry per row is staged in the column past the longest row (a slice, as a uniform
write), and so are the next plain steps' (the stage: columns `_longest - _nst ..` hold every
row's last `_nst` entries; the mask shows each row its own keys and the stage). Attention reads
the same keys either way (up to the longest row). Only when something needs rows in place (a
tree's mask, a verify's compaction, an admission, a narrowed batch: `place`) does each row close
the gap between its own entries and the stage, moving as many of its latest staged entries into
it, in one gather and copy over all layers: a row then holds its entries at 0 .. length - 1, the
latest in any order (attention sums over a row's keys, each carrying its rotated position; only
entries written after the placing, a tree's nodes, are ever cut). A longest row, and a retired
one, move nothing. Placing each step's entry as it came cost 2.4x a slice inside the model's
forward on a CPU as a per-layer indexed copy, and still 2 ms of a 57 ms step (emoji16, 64 images)
as one copy over all layers (3,072 scattered rows, cold in the CPU's caches); moving every staged
entry at once cost 65 ms of the first drafted round after ~100 plain steps there, moving the gaps'
worth ~3 ms. Wider ragged writes (tree verifies) scatter per row.

Lengths live on the host (`host`, numpy) and are mirrored to the device (`lengths`): every change
is host arithmetic copied down, never a read back, so the round's bookkeeping never waits for
the device.
"""

from __future__ import annotations

import numpy as np
import torch


class KVCache:
    def __init__(
        self,
        n_layer: int,
        rows: int,
        n_head: int,
        head_dim: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (n_layer, rows, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, R, heads, max_len, hd)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.valid = torch.ones(rows, max_len, dtype=torch.bool, device=device)  # (R, max_len)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # (R,) committed entries per row
        self.host = np.zeros(rows, dtype=np.int64)  # (R,) the same lengths, on the host
        self._uniform: int | None = 0  # the common length while all rows share one, else None
        self._longest = 0  # max(lengths), kept on the host (no device sync per layer)
        self._nst = 0  # staged columns: each row's last _nst entries sit at columns _longest - _nst .. _longest - 1
        self._fresh = False  # this forward's one entry per row was staged (the next `advance` adds it to the stage)
        self._full = (self.k, self.v)  # the buffers at every row (`narrow` leaves views of their first rows)
        self._index()

    def clear(self) -> None:
        """Empty again, every row, the buffers at their full size (a `CacheStore` hands the cache to
        the next decoder of its shape). The old entries stay in the buffers and are never read: a
        row's keys past its length are masked (`attn_mask`), as a round's rejected tree nodes are."""
        self.k, self.v = self._full
        rows, max_len = self.k.shape[1], self.k.shape[3]
        self.valid = torch.ones(rows, max_len, dtype=torch.bool, device=self.k.device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=self.k.device)
        self.host = np.zeros(rows, dtype=np.int64)
        self._uniform, self._longest, self._nst, self._fresh = 0, 0, 0, False
        self._index()

    def _index(self) -> None:
        """The flat views of k and v, (L, R * heads * max_len, hd) over the same storage, and where
        each row's head starts in them: `_base_host` (R, heads) for the host-built stage moves,
        `_base` its device copy for compaction's device-built indices."""
        n_layer, rows, n_head, max_len, head_dim = self.k.shape
        self._base_host = (np.arange(rows)[:, None] * n_head + np.arange(n_head)) * max_len
        self._base = torch.from_numpy(self._base_host).to(self.k.device)
        self._flat = tuple(x.view(n_layer, rows * n_head * max_len, head_dim) for x in (self.k, self.v))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        """The keys a forward reads before its new ones: the longest row's length (every row's while
        they are uniform; staged entries sit below it)."""
        return self._longest

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + self.valid.numel() + self.lengths.numel() * 8

    # ---- writing ------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (R, heads, S, hd) at each row's [length, length + S); return keys/values
        (R, heads, longest + S, hd)."""
        s = k.shape[2]
        end = self._longest + s
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} > {self.max_len}")
        if self._uniform is not None or s == 1:  # rows of one length, or one entry per row (staged)
            self.k[layer, :, :, self._longest : end] = k
            self.v[layer, :, :, self._longest : end] = v
            self._fresh = self._uniform is None
        else:  # (`attn_mask` placed any stage)
            idx = (self.lengths[:, None] + torch.arange(s, device=k.device))[:, None, :, None]  # (R, 1, S, 1)
            idx = idx.expand(-1, k.shape[1], -1, k.shape[3])
            self.k[layer].scatter_(2, idx, k)
            self.v[layer].scatter_(2, idx, v)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def place(self, emptied: np.ndarray | None = None) -> None:
        """Every row's staged entries (its last `_nst`, at columns S0 = `_longest - _nst` ..) made
        contiguous with its own, in every layer: a row with a gap g (its own entries end at S0 - g)
        moves its last min(g, `_nst`) staged entries into the gap, so it holds its entries at 0 ..
        length - 1, the latest ones out of order when g < `_nst` (attention sums over a row's keys in
        any order: each carries its rotated position; a drafted round's nodes still go after them).
        A longest row moves nothing; an emptied row (its own entries gone; `emptied`: rows about to
        be emptied) neither. One gather and one copy per buffer of exactly the moved entries: moving
        every staged entry of every row cost 65 ms of a 115 ms drafted round after ~100 plain steps
        (emoji16, 64 images)."""
        n = self._nst
        if n == 0:
            return
        self._nst = 0
        s0 = self._longest - n
        own = self.host - n  # (R,) entries each row holds before the stage (<= 0: emptied since)
        if emptied is not None:
            own = np.where(emptied, 0, own)
        moved = np.where(own > 0, np.minimum(s0 - own, n), 0)  # (R,)
        total = int(moved.sum())
        if total:
            rows = np.repeat(np.arange(self.rows), moved)  # (T,) each moved entry's row
            j = np.arange(total) - np.repeat(np.cumsum(moved) - moved, moved)  # (T,) its index among its row's
            src = s0 + n - moved[rows] + j  # (T,) the row's last staged columns
            dst = own[rows] + j  # (T,) its gap, from its own end
            base = self._base_host[rows]  # (T, heads)
            dev = self.lengths.device
            src_t, dst_t = (torch.from_numpy((base + c[:, None]).ravel()).to(dev) for c in (src, dst))
            for flat in self._flat:  # a narrowed cache's buffers are views: per layer
                for part in (flat,) if flat.is_contiguous() else flat:
                    part.index_copy_(-2, dst_t, part.index_select(-2, src_t))
        self._bounds()

    def _bounds(self) -> None:
        """`_longest` and `_uniform` from the host lengths (rows in place)."""
        lo, hi = int(self.host.min()), int(self.host.max())
        self._longest, self._uniform = hi, (hi if lo == hi else None)

    def advance(self, n: int) -> None:
        if self._fresh:  # this forward's staged entry (n == 1) joins the stage
            self._fresh, self._nst = False, self._nst + 1
            self.lengths += 1
            self.host += 1
            self._longest += 1
            return
        self.place()
        self.lengths += n
        self.host += n
        self._longest += n
        if self._uniform is not None:
            self._uniform += n

    def set_lengths(self, lengths: np.ndarray | torch.Tensor) -> None:
        """Per-row lengths (R,), from the host (a numpy array; a tensor is read back once)."""
        host = lengths.detach().cpu().numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
        # rows emptied (free slots) only: the stage stays, and so do the columns read
        keep = self._nst and host.max(initial=0) > 0 and bool(((host == self.host) | (host == 0)).all())
        if not keep:
            self.place(emptied=host == 0)
        self.host = host.astype(np.int64, copy=True)
        self.lengths = torch.from_numpy(self.host.copy()).to(self.lengths.device)
        if not keep:
            self._bounds()

    def truncate(self, length: int | np.ndarray | torch.Tensor) -> None:
        """Back to `length` (one for every row, or per row (R,)); never past a row's length."""
        if isinstance(length, int):
            if length > self._longest:
                raise ValueError(f"cannot truncate to {length} > {self.length}")
            length = np.full(self.rows, length, dtype=np.int64)
        host = length.detach().cpu().numpy() if isinstance(length, torch.Tensor) else np.asarray(length)
        if bool((host > self.host).any()):
            raise ValueError("cannot truncate a row past its length")
        self.set_lengths(host)

    # ---- masks --------------------------------------------------------------------------
    def attn_mask(self, new_mask: torch.Tensor, since: int | torch.Tensor | None = None) -> torch.Tensor:
        """Attention mask (R, 1, S, longest + S) for S new queries per row.

        Keys before `since` (default: each row's length; an int or (R,)) are visible where
        `valid`; keys from `since` on (cached tree nodes, then the S new ones) follow
        `new_mask`, (S, W) or (R, S, W) with column j = key since + j, True = may attend; a row
        uses the first length - since + S columns. A query always sees itself (so a padded
        caption row or a padding node never has an empty row).
        """
        s = new_mask.shape[-2]
        dev = self.valid.device
        if s == 1 and since is None and self._nst and self.length + 1 > self.max_len:
            self.place()  # the stage outgrew the rows: the longest rows emptied (a wave waiting for its
            # last image), the stage ran on past them, and each row's entries fit only in place
        if s == 1 and since is None:  # one query per row: its keys in place, the stage and itself (column
            total = self.length + 1  # `length`: its own, or staged, `write`)
            j = torch.arange(total, device=dev)[None]  # (1, K)
            own = (self.lengths - self._nst)[:, None]  # (R, 1)
            return (((j < own) & self.valid[:, :total]) | (j >= self.length - self._nst))[:, None, None]
        self.place()  # wider queries see rows in place
        total = self.length + s
        if self._uniform is not None and not isinstance(since, torch.Tensor):
            return self._uniform_mask(new_mask, self._uniform if since is None else since, s, total)
        if s == 1:
            raise ValueError("one new entry per row on rows of different lengths is staged: no `since`")
        since_t = self.lengths if since is None else torch.as_tensor(since, device=dev).expand(self.rows)
        w = new_mask.shape[-1]
        j = torch.arange(total, device=dev)[None]  # (1, K)
        valid = self.valid[:, :total]  # (R, K)
        head = (j < since_t[:, None]) & valid  # (R, K)
        rel = j - since_t[:, None]  # (R, K)
        inside = (rel >= 0) & (rel < w) & (j < (self.lengths + s)[:, None])
        nm = new_mask.to(dev).expand(self.rows, s, w)
        tail = nm.gather(2, rel.clamp(0, w - 1)[:, None, :].expand(-1, s, -1)) & (inside & valid)[:, None]
        mask = head[:, None] | tail  # (R, S, K)
        diag = self.lengths[:, None] + torch.arange(s, device=dev)  # (R, S)
        mask.scatter_(2, diag[..., None], True)
        return mask[:, None]

    def _uniform_mask(self, new_mask: torch.Tensor, since: int, s: int, total: int) -> torch.Tensor:
        if new_mask.shape[-1] != total - since:
            raise ValueError(f"new_mask covers {new_mask.shape[-1]} keys, expected {total - since}")
        head = self.valid[:, None, None, :since].expand(-1, 1, s, -1)  # (R, 1, S, since)
        tail = new_mask.to(self.valid.device).expand(self.rows, s, total - since)[:, None]  # (R, 1, S, ...)
        tail = tail & self.valid[:, None, None, since:total]
        mask = torch.cat([head, tail], dim=-1)
        diag = torch.arange(s, device=mask.device)
        mask[:, :, diag, self.length + diag] = True
        return mask

    def narrow(self, rows: np.ndarray) -> None:
        """Keep rows `rows` (n,) as rows 0 .. n - 1 (a batch's tail moved to fewer slots). They
        move within the buffers one layer at a time (the only extra memory is one layer's kept
        rows), and the buffers become views of their first n rows: later forwards compute n rows."""
        self.place()
        n, dev = len(rows), self.k.device
        idx = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(dev)
        for buf in (self.k, self.v):
            for layer in range(buf.shape[0]):
                buf[layer, :n] = buf[layer].index_select(0, idx)
        self.k, self.v = self.k[:, :n], self.v[:, :n]  # (L, n, heads, max_len, hd) views
        self.valid = self.valid.index_select(0, idx)
        self._index()
        self.set_lengths(self.host[np.asarray(rows)])

    # ---- compaction ---------------------------------------------------------------------
    def keep_rows(self, start: np.ndarray, idx: torch.Tensor, counts: np.ndarray) -> None:
        """Per row r keep slots start[r] + idx[r, :counts[r]] (ascending), compacted to
        start[r] .. start[r] + counts[r]. start, counts (R,) on the host; idx (R, m) on the device,
        padded past counts[r] (any in-range value); idx[:, 0] is 0 (the root stays where it is)."""
        self.place()
        hi = min(int(np.max(counts, initial=0)), idx.shape[1])  # columns past every row's count: nothing to keep
        if hi > 1:
            dev = self.k.device
            first = torch.from_numpy(np.asarray(start, dtype=np.int64)).to(dev)[:, None]  # (R, 1)
            src = first + idx[:, 1:hi]  # (R, hi - 1)
            dst = first + torch.arange(1, hi, device=dev)  # (R, hi - 1)
            src, dst = ((self._base[:, :, None] + x[:, None]).flatten() for x in (src, dst))  # entries of `_flat`
            for flat in self._flat:  # one gather and one copy of contiguous hd rows over all layers; per layer
                for part in (flat,) if flat.is_contiguous() else flat:  # on a narrowed cache's views (one call
                    part.index_copy_(-2, dst, part.index_select(-2, src))  # over them took 40x as long)
        self.set_lengths(np.asarray(start) + np.asarray(counts))

    def load_rows(self, rows: torch.Tensor, other: "KVCache") -> None:
        """Copy `other`'s rows (e.g. a prefill) into these rows; each takes its row's length there."""
        self.place()
        other.place()
        n = other.length
        rows = rows.to(self.k.device)
        self.k[:, rows, :, :n] = other.k[:, :, :, :n]
        self.v[:, rows, :, :n] = other.v[:, :, :, :n]
        self.valid[rows] = True
        self.valid[rows, :n] = other.valid[:, :n]
        host = self.host.copy()
        host[rows.cpu().numpy()] = other.host
        self.set_lengths(host)


class CacheStore:
    """The KV caches a Generator keeps between its decoders: one per model, taken by the next
    decoder of the same rows and length instead of a new allocation (`KVCache.clear`). A new
    buffer costs its first touch, a page fault per 4 KiB on a CPU: 7.4 s of CPU for the cache of a
    32-layer target at 64 images in flight, against 0.13 s for a plain step of that batch; a
    worker calls the engine once per batch of prompts. A cache of another shape is dropped before
    the new one is made, so the store never holds more than one cache per model beside the ones
    in use; `release` drops them all (memory for something else)."""

    def __init__(self) -> None:
        self._kept: dict[int, KVCache] = {}  # id(model) -> its last decoder's cache

    def take(self, model, rows: int, max_len: int) -> KVCache:
        """An empty cache of `rows` rows and `max_len` entries for `model` (its `new_cache`)."""
        kept = self._kept.pop(id(model), None)
        if kept is not None:
            kept.clear()  # (the buffers at all their rows again)
            if (kept.rows, kept.max_len) == (rows, max_len):
                return kept
        del kept  # another shape: its memory goes before the new cache's is taken
        return model.new_cache(rows, max_len)

    def give(self, model, cache: KVCache | None) -> None:
        """`model`'s cache, no longer in use: kept for the next `take`."""
        if cache is not None:
            self._kept[id(model)] = cache

    def release(self) -> None:
        self._kept.clear()
