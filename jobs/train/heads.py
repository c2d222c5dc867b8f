"""Drafter head types by model family: what jobs.train_drafter needs to train a family's drafter.

A head type gives three functions:

    build(target, ffn_dim)                        -> a fresh drafter for this target (nn.Module)
    states(target, tokens, captions, cmask, device, amp)
                                                  -> (tokens (2B, L), hidden (2B, T + L - 1, dim) fp32):
                                                     one teacher-forced forward over the cond rows and
                                                     the uncond rows (both CFG rows are drafted)
    head(target)                                  -> the target's output head (features -> logits over codes)

`family_of(bundle)` names a bundle's family from its target's type. A family missing from
HEADS is refused by the job (exit 9); adding one is adding an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jobs.train.drafter import build_drafter, target_states


@dataclass(frozen=True)
class HeadType:
    name: str
    build: Callable
    states: Callable
    head: Callable
    description: str


LLAMAGEN = HeadType(
    "llamagen", build_drafter, target_states, lambda target: target.head,
    "adt_core.models.drafter.Drafter: one decoder layer over fc([token embedding; feature]), the target's "
    "widths and 2-D RoPE, its token embedding copied and frozen; logits through the target's head",
)

HEADS: dict[str, HeadType] = {"llamagen": LLAMAGEN}


def family_of(bundle) -> str:
    """'llamagen' for a LlamaGen target, else the target's class name (a family without a head here)."""
    from adt_core.models.gpt import LlamaGenGPT

    return "llamagen" if isinstance(bundle.target, LlamaGenGPT) else type(bundle.target).__name__
