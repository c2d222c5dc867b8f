"""Drafter head types by model family: what jobs.train_drafter needs to train a family's drafter.

A head type gives:

    build(target, ffn_dim)      -> a fresh drafter for this target (nn.Module with .config)
    prompt_arrays(bundle, prompts, store, say)
                                -> per-prompt numpy arrays the workers receive (driver side, once):
                                   LlamaGen's caption states + masks; a token family's CFG id rows
    pairs(target, drafter, codes (B, L), rows, device, amp, noise, g)
                                -> (f, h) each (2B, L - 1, dim): the drafter's features and the
                                   target's hidden states they regress, cond rows then uncond rows,
                                   from one teacher-forced target forward (both CFG rows are drafted)
    head(target)                -> the target's output head (features -> logits over codes)
    from_state(state, target)   -> the drafter of a training checkpoint's state (eval)
    config_dict(drafter)        -> the exported component's config.json

`family_of(bundle)` names a bundle's family. A family missing from HEADS is refused by the job
(exit 9); adding one is adding an entry here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from jobs.train import token_pairs
from jobs.train.drafter import build_drafter, drafter_outputs, target_states


@dataclass(frozen=True)
class HeadType:
    name: str
    build: Callable
    prompt_arrays: Callable
    pairs: Callable
    head: Callable
    from_state: Callable
    config_dict: Callable
    description: str


# ---- LlamaGen: caption rows, the project's Drafter -----------------------------------------
def _llamagen_arrays(bundle, prompts, store=None, say=print):
    from jobs.train.distill import cached_captions

    enc = bundle.text_encoder
    spec = enc.config() if hasattr(enc, "config") else {"type": type(enc).__name__}
    if store is None:
        from jobs.train.distill import encode_prompts

        states, masks = encode_prompts(enc, prompts, say=say)
    else:
        states, masks = cached_captions(store, enc, spec, prompts, say)
    return {"states": states, "masks": masks}


def _llamagen_pairs(target, drafter, codes, rows, device, amp, noise, g):
    captions = rows["states"].float()
    tok, hidden = target_states(target, codes, captions, rows["masks"], device, amp)
    return drafter_outputs(drafter, tok, hidden, captions.shape[1], noise, g)


def _llamagen_from_state(state, target=None):
    from adt_core.families.llamagen.drafter import Drafter, DrafterConfig

    drafter = Drafter(DrafterConfig(**state["drafter_config"]))
    drafter.load_state_dict(state["model"], strict=True)
    return drafter.eval()


LLAMAGEN = HeadType(
    "llamagen", build_drafter, _llamagen_arrays, _llamagen_pairs, lambda target: target.head, _llamagen_from_state,
    lambda drafter: dataclasses.asdict(drafter.config),
    "adt_core.families.llamagen.drafter.Drafter: one decoder layer over fc([token embedding; feature]), the target's "
    "widths and 2-D RoPE, its token embedding copied and frozen; logits through the target's head",
)


# ---- Janus: token rows, JanusDrafter over the target's image input path and gen_head ------
def _janus_build(target, ffn_dim=None):
    from adt_core.families.janus.drafter import new_drafter

    return new_drafter(target, **({"intermediate_size": ffn_dim} if ffn_dim else {}))


def _janus_from_state(state, target):
    from adt_core.families.janus.drafter import JanusDrafter, JanusDrafterConfig

    drafter = JanusDrafter(JanusDrafterConfig.from_dict(state["drafter_config"], "checkpoint"), target)
    drafter.load_state_dict(state["model"], strict=True)
    p = target.gen_embed.weight
    return drafter.to(p.device).eval()


JANUS = HeadType(
    "janus", _janus_build, token_pairs.prompt_arrays, token_pairs.pairs, lambda target: target.head,
    _janus_from_state, lambda drafter: drafter.config.to_dict(),
    "adt_core.families.janus.drafter.JanusDrafter: one Llama layer (no input norm) over fc([image input path "
    "(gen_embed + gen_aligner); feature]), the target's widths and 1-D RoPE; logits through the target's "
    "gen_head; embedding and head stay the target's (10 tensors trained)",
)

HEADS: dict[str, HeadType] = {"llamagen": LLAMAGEN, "janus": JANUS}
# a family's declared `train_head` kind -> its HEADS entry
HEAD_KINDS = {"captions": "llamagen", "tokens": "janus"}


def family_of(bundle) -> str:
    """The HEADS entry of a bundle's family: the head type its registry entry declares
    (adt_core/families/<name>/family.py `train_head`), else the family's name (refused: no head)."""
    from adt_core.families.registry import get_family

    family = getattr(bundle, "family", "llamagen")
    head = get_family(family).train_head
    return HEAD_KINDS.get(head, family)
