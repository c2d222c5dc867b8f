"""Training pairs for token families (Janus): prompt rows of ids, ragged lengths, the drafter's
context over the prompt as at generation time.

The engine admits a token family's prompt into the drafter's cache as pairs (id k, target hidden
k - 1) for k = 1 .. m - 1 (m: the row's prompt length), then drafts over image pairs. Training
builds the same sequence per CFG row r (cond rows 0 .. B-1, uncond rows B .. 2B-1, each row of
its own length m_r, right-padded):

    x   = prompt ids (m_r) + code ids of codes 0 .. L-2                 (R, S), S = max m_r + L - 1
    h   = target(x) post-norm hidden, one teacher-forced forward         (R, S, D)
    f   = drafter(x[:, 1:], h[:, :-1] + noise) under causal & valid     (R, S - 1, D)

and keeps the image pairs only: pair j (code j at position m_r + j, h at m_r + j - 1) gives
f at index m_r + j - 1, regressing h at index m_r + j (the state that predicts code j + 1),
j = 0 .. L-2: (f, h) (R, L - 1, D), as jobs.train.drafter.drafter_outputs returns for LlamaGen.

Layouts with forced tokens inside the image (Lumina's end-of-line) are refused: their pairs
would need the forced ids between codes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from jobs.train.target import autocast


def prompt_arrays(bundle, prompts: list[str], store=None, say: Callable[[str], None] = print) -> dict[str, np.ndarray]:
    """The prompter's CFG rows of each prompt: ids (P, 2, M) int64, valid (P, 2, M) bool,
    positions (P, 2, M) int64, lengths (P, 2) int64 (row 0 cond, row 1 uncond)."""
    prompter = bundle.make_prompter()
    if prompter.layout.eol is not None:
        raise ValueError("a layout with end-of-line tokens inside the image has no token-family training pairs")
    rows = prompter.rows(prompts, cfg=True)
    if rows.tokens is None:
        raise ValueError(f"{bundle.family}: the prompter gives no token rows")
    p, m = len(prompts), rows.tokens.shape[1]

    def per_prompt(t: torch.Tensor) -> np.ndarray:  # (2P, ...) cond rows then uncond rows -> (P, 2, ...)
        return torch.stack([t[:p], t[p:]], 1).numpy()

    say(f"prompt rows: {p} prompts, up to {m} ids")
    return {"ids": per_prompt(rows.tokens), "valid": per_prompt(rows.valid), "positions": per_prompt(rows.positions),
            "lengths": per_prompt(rows.lengths)}


def sequences(target, codes: torch.Tensor, rows: dict[str, torch.Tensor]):
    """codes (B, L) + the batch's prompt rows -> ids, positions, valid (R, S) and lengths (R,), R = 2B."""
    b, n = codes.shape
    ids, valid, pos = (torch.cat([rows[k][:, 0], rows[k][:, 1]]) for k in ("ids", "valid", "positions"))
    lengths = torch.cat([rows["lengths"][:, 0], rows["lengths"][:, 1]])  # (R,)
    m = int(lengths.max())  # this batch's longest row (the arrays are padded to the whole set's)
    ids, valid, pos = ids[:, :m], valid[:, :m], pos[:, :m]
    r, s = ids.shape[0], m + n - 1
    dev = codes.device
    x = torch.zeros(r, s, dtype=torch.long, device=dev)
    x[:, :m] = ids
    at = lengths[:, None] + torch.arange(n - 1, device=dev)[None]  # (R, L-1) index of code j
    x.scatter_(1, at, target.vocab.to_id(codes[:, :-1]).repeat(2, 1))
    keep = torch.arange(s, device=dev)[None] < (lengths[:, None] + n - 1)  # (R, S)
    in_prompt = torch.arange(s, device=dev)[None] < lengths[:, None]
    v = torch.zeros(r, s, dtype=torch.bool, device=dev)
    v[:, :m] = valid
    v = torch.where(in_prompt, v, keep)
    p = torch.arange(s, device=dev)[None].expand(r, s).clone()
    p[:, :m] = torch.where(in_prompt[:, :m], pos, p[:, :m])
    return x, p, v, lengths


def _mask(valid: torch.Tensor) -> torch.Tensor:
    """(R, S) valid -> (R, 1, S, S) bool: causal over valid keys; a query always sees itself."""
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    return ((causal[None] & valid[:, None, :]) | torch.eye(s, dtype=torch.bool, device=valid.device)[None])[:, None]


def pairs(target, drafter, codes: torch.Tensor, rows: dict[str, torch.Tensor], device, amp: str, noise: float,
          g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (B, L), the batch's prompt rows -> (f, h) each (2B, L - 1, D) (module docstring)."""
    x, pos, valid, lengths = sequences(target, codes, rows)
    with torch.no_grad(), autocast(device, amp):
        _, hidden = target(pos, _mask(valid), None, tokens=x)
    hidden = hidden.float()  # (R, S, D)
    h_in = hidden[:, :-1]
    if noise > 0:
        u = torch.rand(h_in.shape, generator=g).to(h_in.device)
        h_in = h_in + (2 * u - 1) * noise
    with autocast(device, amp):
        f = drafter(x[:, 1:], h_in, pos[:, 1:], _mask(valid[:, 1:]))  # (R, S-1, D): f[k-1] regresses h[k]
    n = codes.shape[1] - 1
    at = (lengths[:, None] + torch.arange(n, device=x.device)[None])[..., None]  # (R, L-1, 1)
    d = hidden.shape[-1]
    return f.gather(1, (at - 1).expand(-1, -1, d)), hidden.gather(1, at.expand(-1, -1, d))
