"""What decoding hands out: per-image results and their statistics (the engine's output types).

Kept apart from the engine so the round (batch.py), the engine (engine.py) and the pipeline's
telemetry all read one definition. Field names here are the telemetry columns' sources.

Vocabulary: a round commits its accepted drafted tokens plus one bonus token; an image's
acceptance length is tokens committed per round, 1 + accepted drafted tokens per round
(vLLM's mean acceptance length). `accepted_lengths` holds accepted DRAFTED tokens per round
(the bonus token excluded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from adt_core.calibrate import CostTable


@dataclass
class RoundTrace:
    position: int  # raster index of the first drafted token (root index + 1)
    depth: int  # draft levels of the tree actually built
    width: int  # top-k per expansion (0 for static trees / root-only rounds)
    nodes: int  # drafted nodes verified (root excluded)
    accepted: int  # accepted drafted tokens (bonus excluded)
    draft_ms: float  # this image's share of the round's draft time
    verify_ms: float  # this image's share of the round's verify time
    slots: int = 1  # images in the round
    tokens: int = 0  # tokens per CFG pair in the round's target forward (slots x widest tree)


@dataclass
class StepStats:
    target_forwards: int = 0  # prefill included
    draft_forwards: int = 0
    draft_tokens: int = 0  # drafted nodes sent to verification
    accepted_draft_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per round: accepted drafted tokens
    draft_ms: float = 0.0  # shares of the rounds' times (round time / images in the round)
    verify_ms: float = 0.0
    total_ms: float = 0.0
    batch_size: int = 1  # the engine's in-flight capacity
    rounds: list[RoundTrace] = field(default_factory=list)
    lossy: bool = False  # True when a relaxed (LANTERN) acceptance was used
    sampler: str = "greedy"  # "greedy" (temperature 0), "coupled" or "rejection": what drew the tokens
    estimated_speedup: float | None = None

    @property
    def num_spec_steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per speculative step: 1 + accepted / steps (vLLM's definition)."""
        steps = self.num_spec_steps
        return 1.0 + self.accepted_draft_tokens / steps if steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class PromptFailure:
    """A prompt that could not be decoded (its row fails; the others in flight go on)."""

    prompt: str
    seed: int
    error: BaseException


@dataclass
class GenerationResult:
    prompt: str
    seed: int
    tokens: torch.Tensor  # (H, W) long, CPU
    image: np.ndarray  # (H*f, W*f, 3) uint8
    stats: StepStats


def estimate_speedup(stats: StepStats, costs: CostTable, num_tokens: int, batch: int) -> float:
    """Batched AR's modelled time per image over this image's: AR at the same batch pays
    num_tokens steps of cost(batch) / batch each; this image paid, per round, its share of a
    forward of the round's width (cost(tokens) / slots) and of the measured draft time."""
    ar = num_tokens * costs.cost(batch) / batch
    spec = sum(costs.cost(max(r.tokens, r.slots)) / r.slots + r.draft_ms for r in stats.rounds)
    return ar / spec if spec > 0 else 1.0
