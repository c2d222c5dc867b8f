"""What decoding hands out: per-image results and their statistics (the engine's output types).

Kept apart from the engine so the round (batch.py), the engine (engine.py) and the pipeline's
telemetry all read one definition. Field names here are the telemetry columns' sources.

Vocabulary: a round commits its accepted drafted tokens plus one bonus token; an image's
acceptance length is tokens committed per round, 1 + accepted drafted tokens per round
(vLLM's mean acceptance length). `accepted_lengths` holds accepted DRAFTED tokens per round
(the bonus token excluded).
"""

from __future__ import annotations

from collections.abc import Sequence
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


class RoundTraces(Sequence):
    """An image's rounds, held as two arrays; a `RoundTrace` is made for each item read. (A few
    hundred RoundTrace objects kept per image made Python's cycle collector scan the heap again
    and again: ~1% of the decoding time at 16 in flight, all of it in the round that finished.)"""

    __slots__ = ("ints", "ms")

    def __init__(self, ints: np.ndarray, ms: np.ndarray) -> None:
        self.ints = ints  # (R, 7) int64: position, depth, width, nodes, accepted, slots, tokens
        self.ms = ms  # (R, 2) float64: draft_ms, verify_ms

    def __len__(self) -> int:
        return len(self.ints)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        p, d, w, n, a, sl, tk = (int(x) for x in self.ints[i])
        dm, vm = (float(x) for x in self.ms[i])
        return RoundTrace(p, d, w, n, a, dm, vm, sl, tk)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"RoundTraces({len(self)} rounds)"


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
    plain_rounds: int = 0  # the plain steps (no draft) this image took part in
    plain_ms: float = 0.0  # its share of their time (included in verify_ms)
    batch_size: int = 1  # the engine's in-flight capacity
    rounds: Sequence[RoundTrace] = field(default_factory=list)  # a RoundTraces from the engine
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
    r = stats.rounds
    if isinstance(r, RoundTraces):  # each distinct (tokens, slots) priced once
        pairs, n = np.unique(np.stack([np.maximum(r.ints[:, 6], r.ints[:, 5]), r.ints[:, 5]], 1), axis=0,
                             return_counts=True)
        spec = sum(c * costs.cost(int(t)) / int(sl) for (t, sl), c in zip(pairs, n)) + float(r.ms[:, 0].sum())
    else:
        spec = sum(costs.cost(max(x.tokens, x.slots)) / x.slots + x.draft_ms for x in r)
    return ar / spec if spec > 0 else 1.0
