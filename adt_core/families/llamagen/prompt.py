"""LlamaGen through the model contract (adt_core/families/contract.py).

LlamaGen conditions on caption states, not on prompt tokens: every prompt row is the T caption
rows of the text encoder (right-aligned, padding masked) and, with CFG, the uncond row is the
target's `uncond_embedding` under the SAME caption mask. Both rows are T long, so image index i
sits at position T + i in every row; there are no forced tokens and id == code.

`LlamaGenPrompter` wraps the bundle's text encoder and target (read on every call, so a test or
a caller may swap either); the target itself already speaks the contract (`forward(positions,
mask, cache, tokens=, embeds=)`, `head`, `new_cache`, `vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from adt_core.families.contract import ImageVocab, Layout, PromptRows


def llamagen_vocab(vocab_size: int) -> ImageVocab:
    return ImageVocab(first_id=0, num_codes=vocab_size, vocab_size=vocab_size)


def caption_rows(target, captions: torch.Tensor, cmask: torch.Tensor, cfg: bool) -> PromptRows:
    """PromptRows from encoded captions (n, T, C) and their mask (n, T): cond rows, then (CFG)
    the target's uncond_embedding under the same mask. Positions 0 .. T - 1, every row T long."""
    n, t = captions.shape[0], captions.shape[1]
    embeds, valid = captions, cmask
    if cfg:
        uncond = target.cls_embedding.uncond_embedding.to(captions.device, captions.dtype)  # (T, C)
        embeds, valid = torch.cat([captions, uncond.expand_as(captions)]), torch.cat([cmask, cmask])
    r = embeds.shape[0]
    positions = torch.arange(t, device=captions.device)[None].expand(r, t)
    lengths = torch.full((r,), t, dtype=torch.long, device=captions.device)
    return PromptRows(None, embeds, valid, positions, lengths, n)


@dataclass
class LlamaGenPrompter:
    """prompts -> caption PromptRows; the layout is the bundle's grid with no forced tokens."""

    text_encoder: object
    target: object
    grid: tuple[int, int]

    def __post_init__(self) -> None:
        tc = self.target.config
        enc = self.text_encoder
        if (enc.max_tokens, enc.dim) != (tc.cls_token_num, tc.caption_dim):
            raise ValueError(
                f"text encoder gives {enc.max_tokens} x {enc.dim} caption states, "
                f"target expects {tc.cls_token_num} x {tc.caption_dim}"
            )
        self.layout = Layout(int(self.grid[0]), int(self.grid[1]))
        self.vocab = llamagen_vocab(tc.vocab_size)
        self.max_prompt = tc.cls_token_num  # every row is T caption entries
        self.typical_prompt = tc.cls_token_num

    def rows(self, prompts: Sequence[str], cfg: bool) -> PromptRows:
        captions, cmask = self.text_encoder.encode(list(prompts))
        return caption_rows(self.target, captions, cmask, cfg)
