"""Frozen configuration dataclasses for decoding.

Every knob of a decode lives here, so one `DecodeConfig` fully describes how an image was
made (it is saved beside outputs and hashed into telemetry). Fields that are `None` take the
bundle's sampling defaults (see `SamplingConfig` and `Bundle.sampling`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ar", "static", "eagle2", "adt", "jacobi")
SHAPED = ("adt", "jacobi")  # methods whose trees ADT-Tree's controller (AdaptiveConfig) shapes
DRAFTERLESS = ("ar", "jacobi")  # methods that run without a drafter model
DTYPES = ("float32", "bfloat16", "float16")
SAMPLERS = ("coupled", "rejection")
DRAFT_SCORES = ("perturbed", "logq")


def _check(ok: bool, field_name: str, rule: str, value: Any) -> None:
    """Raise ValueError naming the field (dotted) when a validation rule fails."""
    if not ok:
        raise ValueError(f"{field_name} must be {rule}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn from the target's logits.

    temperature: 0 means greedy (argmax); > 0 divides logits before softmax.
    top_k: keep the k most likely tokens (0 = all). LlamaGen uses 1000.
    top_p: keep the smallest set whose mass reaches p (1.0 = all).
    cfg_scale: classifier-free guidance s in uncond + s * (cond - uncond); 1.0 runs no uncond row.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    cfg_scale: float = 1.0

    def __post_init__(self) -> None:
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature", "a finite number >= 0",
               self.temperature)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0", self.top_k)
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(_is_real(self.cfg_scale) and self.cfg_scale >= 1.0, "cfg_scale", "a finite number >= 1",
               self.cfg_scale)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0


EAGLE2_TREE = {"depth": 5, "top_k": 10, "budget": 58}  # EAGLE-2's figures for a tree fixed by hand


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree.

    depth: draft levels (EAGLE-2 for visual AR: 5 levels).
    top_k: children expanded per node and frontier size per level (EAGLE-2: 10).
    budget: draft nodes kept after reranking (EAGLE-2's "total tokens" minus the root: 58).
        None for all three (the default): method "eagle2" sizes its tree for this device, every
        round, from the measured costs and acceptance (adt_core/round/eagle_plan.py `SizedEaglePlanner`;
        58 nodes is a GPU's figure). Any one set fixes the tree by hand, the others taking
        EAGLE-2's figures (5, 10, 58), as does a static tree.
    static_paths: for method "static", the fixed tree as a list of paths of child ranks,
        e.g. ((0,), (1,), (0, 0)) = two children of the root and one grandchild under the first.
    """

    depth: int | None = None
    top_k: int | None = None
    budget: int | None = None
    static_paths: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        hand = any(getattr(self, n) is not None for n in EAGLE2_TREE) or self.static_paths is not None
        for name, paper in EAGLE2_TREE.items():
            v = getattr(self, name)
            if v is None and hand:
                object.__setattr__(self, name, v := paper)
            _check(v is None or (_is_int(v) and v >= 1), f"tree.{name}", "none or an integer >= 1", v)
        if self.static_paths is not None:
            object.__setattr__(self, "static_paths", tuple(tuple(int(i) for i in p) for p in self.static_paths))
            paths = set(self.static_paths)
            for p in self.static_paths:
                if len(p) == 0 or min(p) < 0:
                    raise ValueError(f"static path {p} must be a non-empty tuple of ranks >= 0")
                if len(p) > 1 and p[:-1] not in paths:
                    raise ValueError(f"static path {p} lacks its parent {p[:-1]}")

    @property
    def sized(self) -> bool:
        """Sized for the device by the cost budget (no field set by hand)."""
        return self.depth is None


@dataclass(frozen=True)
class AdaptiveConfig:
    """ADT-Tree controller constants (see docs/adt_tree.md). Used when method == "adt"."""

    d0: int = 5
    k0: int = 10
    beta: float = 0.5
    d_min: int = 2
    d_max: int = 8
    k_min: int = 2
    k_max: int = 16
    n_min: int = 8
    n_max: int = 64
    gamma: float = 1.0
    init: str = "horizontal"  # horizontal | vertical | both
    mode: str = "bisect"  # bisect | step
    l_d: int = 1
    l_k: int = 2
    # cost: the batch cost budget (adt_core/round/budget.py) sizes every round from this device's measured
    # costs, and never drafts where it does not pay; shape: the paper's fixed n = gamma d k trees,
    # slower wherever a verify forward is not flat in its width (a CPU, a large batch)
    budget: str = "cost"  # cost | shape

    def __post_init__(self) -> None:
        f = lambda name: f"adaptive.{name}"  # noqa: E731
        for name in ("d0", "k0", "d_min", "d_max", "k_min", "k_max", "n_min", "n_max", "l_d", "l_k"):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 1, f(name), "an integer >= 1", v)
        _check(_is_real(self.beta) and 0.0 <= self.beta <= 1.0, f("beta"), "in [0, 1]", self.beta)
        _check(_is_real(self.gamma) and self.gamma > 0, f("gamma"), "a finite number > 0", self.gamma)
        for lo, hi in (("d_min", "d_max"), ("k_min", "k_max"), ("n_min", "n_max")):
            _check(getattr(self, lo) <= getattr(self, hi), f(lo), f"<= {f(hi)} ({getattr(self, hi)})", getattr(self, lo))
        _check(self.init in ("horizontal", "vertical", "both"), f("init"), "horizontal, vertical or both", self.init)
        _check(self.mode in ("bisect", "step"), f("mode"), "bisect or step", self.mode)
        _check(self.budget in ("shape", "cost"), f("budget"), "shape or cost", self.budget)


@dataclass(frozen=True)
class LanternConfig:
    """LANTERN relaxed acceptance (lossy). lam=None: LANTERN (delta); lam set: LANTERN++."""

    k: int = 100
    delta: float = 0.5
    lam: float | None = None

    def __post_init__(self) -> None:
        _check(_is_int(self.k) and self.k >= 1, "lantern.k", "an integer >= 1", self.k)
        _check(_is_real(self.delta) and 0.0 <= self.delta <= 1.0, "lantern.delta", "in [0, 1]", self.delta)
        _check(self.lam is None or (_is_real(self.lam) and self.lam >= 1.0), "lantern.lam", "none or a number >= 1",
               self.lam)


@dataclass(frozen=True)
class DecodeConfig:
    """Everything that decides how images are decoded.

    method: "adt" (default: adjacency-adaptive trees sized by the cost budget), "ar" (vanilla,
        the baseline), "static" (fixed tree), "eagle2" (dynamic tree), "jacobi" (no drafter:
        trees from the target's own earlier predictions and the image's neighbours, shaped as
        "adt"'s; adt_core/round/jacobi.py).
    temperature / top_k / top_p / cfg_scale: None takes the bundle's defaults.
    sampler: "coupled" (default: Gumbel-max noise fixed per (seed, position, token); every method
        gives AR's tokens for the same seed) or "rejection" (recursive rejection sampling,
        lossless in distribution only). Ignored when greedy (temperature 0).
    draft_score: path score of coupled drafts for EAGLE-2 reranking and the cost budget:
        "perturbed" (log-softmax of the drafter's warped logits plus the noise: a match
        probability) or "logq" (cumulative log q, EAGLE-2's own); see docs/adt_tree.md.
    batch_size: images in flight in one Generator (continuous refill; every method).
    device: "cpu", "cuda", "cuda:0", ...; dtype: "float32" | "bfloat16" | "float16" (or the
        torch dtype).
    max_tokens: stop after this many image tokens (None = the whole grid); the rest of the
        grid is filled with token 0. For tests and calibration only.
    """

    method: str = "adt"
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    cfg_scale: float | None = None
    tree: TreeConfig = field(default_factory=TreeConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    lantern: LanternConfig | None = None
    sampler: str = "coupled"
    draft_score: str = "perturbed"
    batch_size: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch.dtype: store its name
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        _check(self.method in METHODS, "method", f"one of {METHODS}", self.method)
        _check(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        _check(self.sampler in SAMPLERS, "sampler", f"one of {SAMPLERS}", self.sampler)
        _check(self.draft_score in DRAFT_SCORES, "draft_score", f"one of {DRAFT_SCORES}", self.draft_score)
        _check(_is_int(self.batch_size) and self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               "none or an integer >= 1", self.max_tokens)
        for name in ("temperature", "top_k", "top_p", "cfg_scale"):
            if getattr(self, name) is not None:  # full check with the bundle's defaults in sampling()
                SamplingConfig(**{name: getattr(self, name)})
        if self.method == "jacobi" and self.lantern is not None and self.sampler == "rejection":
            raise ValueError("lantern with method jacobi needs sampler coupled (or temperature 0): jacobi's "
                             "rejection sampler is SJD's rule, which has no relaxed form here")
        if self.method == "static" and self.tree.static_paths is None:
            object.__setattr__(self, "tree", dataclasses.replace(self.tree, static_paths=default_static_paths()))

    @property
    def shaped(self) -> bool:
        """Trees shaped by ADT-Tree's controller and sized by `adaptive` (adt, jacobi)."""
        return self.method in SHAPED

    @property
    def cost_sized(self) -> bool:
        """Trees sized by the cost budget from this device's measured costs (adt and jacobi with
        budget "cost"; eagle2 with its tree unset)."""
        return (self.shaped and self.adaptive.budget == "cost") or (self.method == "eagle2" and self.tree.sized)

    @property
    def needs_drafter(self) -> bool:
        return self.method not in DRAFTERLESS

    def sampling(self, defaults: SamplingConfig) -> SamplingConfig:
        """The effective sampling config: our fields where set, else the bundle's."""
        pick = lambda ours, theirs: theirs if ours is None else ours  # noqa: E731
        return SamplingConfig(
            temperature=pick(self.temperature, defaults.temperature),
            top_k=pick(self.top_k, defaults.top_k),
            top_p=pick(self.top_p, defaults.top_p),
            cfg_scale=pick(self.cfg_scale, defaults.cfg_scale),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DecodeConfig":
        d = dict(d)
        if isinstance(d.get("tree"), dict):
            tree = dict(d["tree"])
            if tree.get("static_paths") is not None:
                tree["static_paths"] = tuple(tuple(p) for p in tree["static_paths"])
            d["tree"] = TreeConfig(**tree)
        if isinstance(d.get("adaptive"), dict):
            d["adaptive"] = AdaptiveConfig(**d["adaptive"])
        if isinstance(d.get("lantern"), dict):
            d["lantern"] = LanternConfig(**d["lantern"])
        return cls(**d)

    def config_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def default_static_paths() -> tuple[tuple[int, ...], ...]:
    """A fixed 5-level tree of 25 nodes: wide near the root, a single chain at depth."""
    paths: list[tuple[int, ...]] = [(i,) for i in range(6)]
    paths += [(0, i) for i in range(4)] + [(1, i) for i in range(2)] + [(2, 0), (3, 0)]
    paths += [(0, 0, i) for i in range(3)] + [(0, 1, 0), (1, 0, 0)]
    paths += [(0, 0, 0, i) for i in range(2)] + [(0, 0, 1, 0)]
    paths += [(0, 0, 0, 0, 0), (0, 0, 0, 1, 0)]
    return tuple(paths)
