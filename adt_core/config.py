"""Frozen configuration dataclasses for decoding.

Every knob of a decode lives here, so one `DecodeConfig` fully describes how an image was
made (it is saved beside outputs and hashed into telemetry). Fields that are `None` take the
bundle's sampling defaults (see `SamplingConfig` and `Bundle.sampling`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ar", "static", "eagle2", "adt")
DTYPES = ("float32", "bfloat16", "float16")


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
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.cfg_scale < 1.0:
            raise ValueError(f"cfg_scale must be >= 1, got {self.cfg_scale}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree.

    depth: draft levels (EAGLE-2 for visual AR: 5 levels).
    top_k: children expanded per node and frontier size per level (EAGLE-2: 10).
    budget: draft nodes kept after reranking (EAGLE-2's "total tokens" minus the root: 58).
    static_paths: for method "static", the fixed tree as a list of paths of child ranks,
        e.g. ((0,), (1,), (0, 0)) = two children of the root and one grandchild under the first.
    """

    depth: int = 5
    top_k: int = 10
    budget: int = 58
    static_paths: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.budget < 1:
            raise ValueError(f"tree depth, top_k and budget must be >= 1, got {self}")
        if self.static_paths is not None:
            object.__setattr__(self, "static_paths", tuple(tuple(int(i) for i in p) for p in self.static_paths))
            paths = set(self.static_paths)
            for p in self.static_paths:
                if len(p) == 0 or min(p) < 0:
                    raise ValueError(f"static path {p} must be a non-empty tuple of ranks >= 0")
                if len(p) > 1 and p[:-1] not in paths:
                    raise ValueError(f"static path {p} lacks its parent {p[:-1]}")


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
    budget: str = "shape"  # shape | cost


@dataclass(frozen=True)
class LanternConfig:
    """LANTERN relaxed acceptance (lossy). lam=None: LANTERN (delta); lam set: LANTERN++."""

    k: int = 100
    delta: float = 0.5
    lam: float | None = None


@dataclass(frozen=True)
class DecodeConfig:
    """Everything that decides how images are decoded.

    method: "ar" (vanilla, the baseline), "static" (fixed tree), "eagle2" (dynamic tree),
        "adt" (adjacency-adaptive tree).
    temperature / top_k / top_p / cfg_scale: None takes the bundle's defaults.
    device: "cpu", "cuda", "cuda:0", ...; dtype: "float32" | "bfloat16" | "float16".
    max_tokens: stop after this many image tokens (None = the whole grid); the rest of the
        grid is filled with token 0. For tests and calibration only.
    """

    method: str = "eagle2"
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    cfg_scale: float | None = None
    tree: TreeConfig = field(default_factory=TreeConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    lantern: LanternConfig | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.method == "static" and self.tree.static_paths is None:
            object.__setattr__(self, "tree", dataclasses.replace(self.tree, static_paths=default_static_paths()))

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
