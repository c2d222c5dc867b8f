"""The model contract: what the engine knows of a model family, and no more.

A family (LlamaGen, Chameleon, Janus: adt_core/families/registry.py) supplies these behind small
interfaces:

    Prompter   prompts -> PromptRows (cond rows, then uncond rows with CFG), its Layout, its ImageVocab
    Layout     image index i -> offset in the generated sequence; forced tokens; image (row, col) of i
    ImageVocab which ids are image codes; code <-> id
    Target     forward(positions, mask, cache, tokens | embeds) -> (logits over CODES, hidden)
    Drafter    forward(tokens, hidden, positions, mask, cache) -> features (through target.head)
    Decoder    codes (B, H, W) -> uint8 pixels (B, H*f, W*f, 3)

Optional members (a position table, a LANTERN drafter's caption pairs, a VQ-GAN decoder's
channels) are declared at the end of this file and read only through its functions there.

Vocabulary used below. Image index i in [0, N), N = H * W codes in raster order. A row r
(a KV-cache row: slot b is row b (cond) and, with CFG, row B + b (uncond)) holds its prompt
entries 0 .. base[r] - 1 (base = PromptRows.lengths), then the generated sequence: image
index i sits at position base[r] + layout.offset(i). Forced tokens (Lumina's end-of-line after
every image row, the image-end token) are never sampled: their ids and offsets come from the
layout. Syntax tokens that open the image (image start, Lumina's two size tokens) end every
prompt row (`Layout.head`), so they are prefilled, not generated.

The engine works in image-index and code space only: it turns codes into input ids with
`ImageVocab.to_id` and reads logits that already cover codes only (column c = code c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from adt_core.kv_cache import KVCache


# ---- vocabulary ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageVocab:
    """Image codes are the contiguous ids first_id .. first_id + num_codes - 1 (code = id - first_id)."""

    first_id: int  # id of code 0 (LlamaGen 0, Chameleon 4)
    num_codes: int  # V: codebook size (LlamaGen 16384, Chameleon 8192)
    vocab_size: int  # every id the model embeds (Chameleon 65536)

    def __post_init__(self) -> None:
        if self.first_id < 0 or self.num_codes < 1 or self.first_id + self.num_codes > self.vocab_size:
            raise ValueError(f"image ids {self.first_id}..{self.first_id + self.num_codes - 1} "
                             f"do not fit a vocabulary of {self.vocab_size}")

    @property
    def id_slice(self) -> slice:
        return slice(self.first_id, self.first_id + self.num_codes)

    def to_id(self, codes: torch.Tensor) -> torch.Tensor:
        return codes + self.first_id

    def to_code(self, ids: torch.Tensor) -> torch.Tensor:
        return ids - self.first_id

    def is_code(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.first_id) & (ids < self.first_id + self.num_codes)


# ---- layout -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForcedTokens:
    offsets: torch.Tensor  # (F,) long: offsets from a row's base, ascending
    ids: torch.Tensor  # (F,) long: the token at each offset


@dataclass(frozen=True)
class Layout:
    """Where image index i and the forced tokens sit in the generated sequence of one row.

    Offsets count from the row's base (its prompt length): image index i is at
    offset(i) = i + (i // W if eol is not None else 0). With an end-of-line id every image row
    of W codes is followed by it (stride W + 1); `end`, when set, follows the last code (and its
    end-of-line). `head` ids end every prompt row (image start, size tokens): prefilled, never
    generated, listed here so a whole sequence can be assembled and checked.
    """

    grid_h: int  # H: image rows of codes
    grid_w: int  # W: codes per image row
    head: tuple[int, ...] = ()  # ids that end every prompt row (LlamaGen: none)
    eol: int | None = None  # end-of-line id after each image row (Lumina 8803)
    end: int | None = None  # image-end id after the last code (Chameleon 8196)

    @property
    def num_codes(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def stride(self) -> int:
        """Sequence positions per image row."""
        return self.grid_w + (self.eol is not None)

    @property
    def length(self) -> int:
        """Generated tokens per row: codes plus every forced token."""
        return self.grid_h * self.stride + (self.end is not None)

    def offset(self, index: torch.Tensor | int) -> torch.Tensor | int:
        """Offset of image index i (int or any-shaped long tensor) from the row's base."""
        return index + index // self.grid_w if self.eol is not None else index

    def rowcol(self, index: torch.Tensor | int) -> tuple:
        """Image (row, col) of index i: ADT-Tree's adjacency reads these, not the flat index."""
        return index // self.grid_w, index % self.grid_w

    def forced_after(self, index: int) -> tuple[int, ...]:
        """Ids forced right after image index i (in order), possibly none."""
        out: list[int] = []
        if self.eol is not None and index % self.grid_w == self.grid_w - 1:
            out.append(self.eol)
        if self.end is not None and index == self.num_codes - 1:
            out.append(self.end)
        return tuple(out)

    def forced(self) -> ForcedTokens:
        offsets, ids = [], []
        if self.eol is not None:
            offsets = [r * self.stride + self.grid_w for r in range(self.grid_h)]
            ids = [self.eol] * self.grid_h
        if self.end is not None:
            offsets.append(self.length - 1)
            ids.append(self.end)
        return ForcedTokens(torch.tensor(offsets, dtype=torch.long), torch.tensor(ids, dtype=torch.long))

    def assemble(self, code_ids: torch.Tensor) -> torch.Tensor:
        """code ids (N,) in raster order -> head + generated sequence (len(head) + length,)."""
        if code_ids.shape != (self.num_codes,):
            raise ValueError(f"expected {self.num_codes} code ids, got {tuple(code_ids.shape)}")
        seq = torch.empty(self.length, dtype=torch.long, device=code_ids.device)
        seq[self.offset(torch.arange(self.num_codes, device=code_ids.device))] = code_ids.long()
        forced = self.forced()
        seq[forced.offsets.to(seq.device)] = forced.ids.to(seq.device)
        return torch.cat([torch.tensor(self.head, dtype=torch.long, device=seq.device), seq])

    def split(self, seq: torch.Tensor) -> torch.Tensor:
        """Inverse of `assemble`: checks every head and forced token, returns code ids (H, W)."""
        n_head = len(self.head)
        if seq.shape != (n_head + self.length,):
            raise ValueError(f"expected {n_head + self.length} ids, got {tuple(seq.shape)}")
        if seq[:n_head].tolist() != list(self.head):
            raise ValueError(f"head {seq[:n_head].tolist()} != {list(self.head)}")
        body = seq[n_head:]
        forced = self.forced()
        bad = (body[forced.offsets.to(body.device)] != forced.ids.to(body.device)).nonzero().flatten()
        if bad.numel():
            off = int(forced.offsets[bad[0]])
            raise ValueError(f"offset {off}: id {int(body[off])}, the layout forces {int(forced.ids[bad[0]])}")
        idx = self.offset(torch.arange(self.num_codes, device=body.device))
        return body[idx].view(self.grid_h, self.grid_w)


# ---- prompt rows --------------------------------------------------------------------------
@dataclass
class PromptRows:
    """What to prefill for B prompts: rows 0..B-1 cond, then (with CFG) rows B..2B-1 uncond.

    Each row r keeps entries 0 .. lengths[r] - 1 after the prefill (`KVCache.set_lengths`), at
    positions 0 .. lengths[r] - 1; its first image code sits at position lengths[r]. Entries
    past a row's length are right padding (dropped); `valid` False inside the length marks
    entries that stay in the cache but no query may see (LlamaGen's padded caption rows).
    """

    tokens: torch.Tensor | None  # (R, L) long ids, right-padded (token families), else None
    embeds: torch.Tensor | None  # (R, L, E) float prompt states (LlamaGen captions), else None
    valid: torch.Tensor  # (R, L) bool: False on padding and masked entries
    positions: torch.Tensor  # (R, L) long: sequence positions, each row from 0
    lengths: torch.Tensor  # (R,) long: entries each row keeps; = position of its first code
    images: int  # B; R = 2B with CFG, else B

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def cfg(self) -> bool:
        return self.rows == 2 * self.images

    def select(self, start: int, stop: int) -> "PromptRows":
        """Images start .. stop - 1 (their cond rows, then their uncond rows), as `rows` would make
        them for those prompts alone: padding trimmed to their longest row."""
        b = self.images
        idx = torch.arange(start, stop, device=self.lengths.device)
        if self.cfg:
            idx = torch.cat([idx, idx + b])
        lengths = self.lengths[idx]
        n = int(lengths.max()) if idx.numel() else 0
        cut = lambda x: None if x is None else x[idx.to(x.device), :n]  # noqa: E731
        return PromptRows(cut(self.tokens), cut(self.embeds), cut(self.valid), cut(self.positions), lengths,
                          stop - start)

    def causal_mask(self) -> torch.Tensor:
        """(R, 1, L, L) bool prefill mask: causal over valid keys; a query always sees itself."""
        n = self.valid.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.valid.device).tril()
        mask = causal[None] & self.valid[:, None, :]
        mask |= torch.eye(n, dtype=torch.bool, device=self.valid.device)[None]
        return mask[:, None]


def token_rows(rows: Sequence[Sequence[int]], images: int, pad_id: int = 0) -> PromptRows:
    """PromptRows from per-row id lists (cond rows first, then uncond rows), right-padded."""
    n = max(len(r) for r in rows)
    tokens = torch.full((len(rows), n), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        valid[i, : len(r)] = True
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    positions = torch.arange(n, dtype=torch.long)[None].expand(len(rows), n).clone()
    return PromptRows(tokens, None, valid, positions, lengths, images)


# ---- the model side -----------------------------------------------------------------------
@runtime_checkable
class Prompter(Protocol):
    layout: Layout
    vocab: ImageVocab
    max_prompt: int  # the longest prompt row (entries before image index 0): sizes the decoder's cache
    typical_prompt: int  # a typical prompt row's entries: the cost table's mid-image state

    def rows(self, prompts: Sequence[str], cfg: bool) -> PromptRows: ...


@runtime_checkable
class Target(Protocol):
    vocab: ImageVocab

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache: ...

    def forward(self, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache | None = None,
                tokens: torch.Tensor | None = None, embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (R, S); mask (R, 1, S, K) bool; tokens (R, S) ids or embeds (R, S, E).
        Returns logits over codes (R, S, V) fp32 and hidden states (R, S, D) for the drafter."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, S, D) -> logits over codes (R, S, V) fp32 (drafter features go through it)."""
        ...


@runtime_checkable
class Drafter(Protocol):
    fc: torch.nn.Linear  # EAGLE's input projection fc([embed(token); hidden]): its weight gives width, device, dtype

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache: ...

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens (R, S) ids at `positions`; hidden (R, S, D) = target state one position
        earlier; mask (R, 1, S, K) bool. Returns features (R, S, D) for target.head."""
        ...


@runtime_checkable
class Decoder(Protocol):
    @property
    def downsample_factor(self) -> int: ...

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, H, W) long -> uint8 images (B, H*f, W*f, 3)."""
        ...


# ---- optional members ---------------------------------------------------------------------
# A family's model may have these or not; the engine reads them through these functions only:
#   Target.rope, Drafter.rope     a position table (LlamaGen's 2-D RoPE): later positions clamp to its end
#   Drafter.config.caption_pairs  True: the drafter reads (code 0, h_j) pairs at caption positions (LANTERN)
#   Decoder.cfg.ch, .ch_mult      a VQ-GAN decoder's channels (its full-resolution level's activations)
def max_position(model: Target | Drafter) -> int | None:
    """The last position a model's position table holds (None: no table, positions unbounded)."""
    rope = getattr(model, "rope", None)
    return len(rope) - 1 if rope is not None else None


def reads_caption_pairs(drafter: Drafter) -> bool:
    """Whether a drafter reads the caption positions' pairs on admission (LANTERN-style drafters)."""
    return bool(getattr(getattr(drafter, "config", None), "caption_pairs", False))


def full_res_channels(decoder: Decoder) -> int | None:
    """Channels of a VQ-GAN decoder's full-resolution level (None: not a VQ-GAN decoder)."""
    cfg = getattr(decoder, "cfg", None)
    if cfg is None or not hasattr(cfg, "ch"):
        return None
    return cfg.ch * cfg.ch_mult[0]
