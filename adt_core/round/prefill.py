"""A prompt's rows into a fresh cache: each row keeps its own length (a family's uncond row may
be shorter than its cond row); the round then appends image tokens after them."""

from __future__ import annotations

import numpy as np
import torch

from adt_core.families.contract import PromptRows


def prefill_rows(target, rows: PromptRows, cache, lengths: np.ndarray | None = None):
    """Run prompt rows (cond, then uncond with CFG) into `cache` (empty, rows.rows rows): each
    row keeps its own length; returns logits (R, V) at each row's last prompt entry and hidden
    (R, L, dim) over every entry."""
    if lengths is None:
        lengths = rows.lengths.cpu().numpy().astype(np.int64)
    n, dev = rows.valid.shape[1], cache.valid.device
    # entries past a row's length are padding the image tokens overwrite: valid for later queries
    past = torch.arange(n, device=dev)[None] >= torch.from_numpy(lengths).to(dev)[:, None]
    cache.valid[:, :n] = rows.valid.to(dev) | past
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    inputs = {"tokens": rows.tokens.to(dev)} if rows.tokens is not None else {"embeds": rows.embeds.to(dev)}
    logits, hidden = target(rows.positions.to(dev), cache.attn_mask(causal), cache, **inputs)
    cache.set_lengths(lengths)
    if int(lengths.min()) == n:  # every row full (LlamaGen's caption rows): the last entry
        return logits[:, -1], hidden
    at = torch.from_numpy(lengths - 1).to(dev)
    return logits[torch.arange(logits.shape[0], device=dev), at], hidden

