"""The three ways the next token is drawn, each a strategy picked once per Generator.

- greedy (temperature 0): y = argmax of the CFG-mixed logits;
- coupled: y = argmax(warped logits + Gumbel noise fixed per (seed, image index, token)), an exact
  draw from p whatever produced the logits (adt_core/round/noise.py);
- rejection: one multinomial draw per image from its own torch.Generator, and recursive
  rejection over each tree (adt_core/round/verify.verify_stochastic). This one keeps a per-slot loop:
  every image's draws must come from its own generator, in order.

`targets` gives y at every tree node at once for the whole batch (greedy and coupled); the
rejection sampler has no targets (its verification is per slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adt_core.config import SamplingConfig
from adt_core.round.noise import keyed_gumbel
from adt_core.round.sampling import perturbed, target_probs


@dataclass(frozen=True)
class Sampler:
    kind: str  # "greedy" | "coupled" | "rejection"
    sampling: SamplingConfig
    vocab: int

    @classmethod
    def pick(cls, sampling: SamplingConfig, configured: str, vocab: int) -> "Sampler":
        return cls("greedy" if sampling.greedy else configured, sampling, vocab)

    @property
    def vectorised(self) -> bool:
        """True when verification is whole-batch tensor work (greedy, coupled)."""
        return self.kind != "rejection"

    def noise(self, keys: torch.Tensor, first: torch.Tensor, count: int) -> torch.Tensor | None:
        """Coupled Gumbel rows of image indices first .. first + count - 1: keys (the seeds'
        `seed_keys`), first (C,) -> (C, count, V); None unless coupled."""
        if self.kind != "coupled":
            return None
        pos = first[:, None] + torch.arange(count, device=first.device)  # (C, count)
        return keyed_gumbel(keys, pos, self.vocab)

    def targets(self, mixed: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """y at every node: mixed (C, S, V) CFG-mixed logits, noise (C, S, V) or None -> (C, S)."""
        return perturbed(mixed, self.sampling, noise).argmax(-1)

    def sample(self, mixed: torch.Tensor, keys: torch.Tensor, index: torch.Tensor,
               gens: list[torch.Generator | None]) -> torch.Tensor:
        """One token per slot: mixed (C, V) at image indices index (C,) -> (C,).
        Rejection: slots without a generator (free) draw nothing (token 0)."""
        if self.kind == "rejection":
            probs = target_probs(mixed, self.sampling)  # (C, V)
            out = torch.zeros(mixed.shape[0], dtype=torch.long, device=mixed.device)
            for b, g in enumerate(gens):
                if g is not None:
                    out[b] = torch.multinomial(probs[b], 1, generator=g)[0]
            return out
        noise = self.noise(keys, index, 1)
        return self.targets(mixed[:, None], noise)[:, 0]
