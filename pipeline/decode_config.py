"""The job's `decode` section: the engine's own DecodeConfig, as a pydantic model.

The models here are generated from adt_core.config's frozen dataclasses (DecodeConfig with
its TreeConfig, AdaptiveConfig and LanternConfig): the same fields, the same defaults, and
the engine's own rules (each dataclass's __post_init__), run when a job is validated. So a
job can set every engine field from YAML or the command line (`decode.adaptive.d_max`,
`decode.lantern.delta`, `decode.tree.static_paths`, ...) and nothing here can drift from
the engine. Only `device` is left out: each actor sets it (JobConfig.device).

What this module adds is the documentation of each field (FIELD_DOCS, shown by
`jobs.generate --help`; a "doc" in the dataclass field's metadata takes precedence) and the
choices of the string fields the engine lists (METHODS, ...).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from adt_core.config import DRAFT_SCORES, DTYPES, METHODS, SAMPLERS, DecodeConfig

SKIPPED = ("device",)  # set per actor from JobConfig.device, never by the job's decode section
CHOICES: dict[str, tuple[str, ...]] = {"method": METHODS, "dtype": DTYPES, "sampler": SAMPLERS,
                                       "draft_score": DRAFT_SCORES}

# dotted name (relative to decode) -> help text; a section's own entry documents the section
FIELD_DOCS: dict[str, str] = {
    "method": "Decoder: adt (adjacency-adaptive trees sized by the cost budget; decode.adaptive.*), ar (vanilla, "
              "the baseline), static (a fixed tree: decode.tree.static_paths), eagle2 (dynamic tree: decode.tree.*), "
              "jacobi (no drafter: trees from the target's own earlier predictions and the image's neighbours, "
              "shaped and sized as adt's: decode.adaptive.*).",
    "temperature": "Sampling temperature; 0 = greedy; none = the bundle's default.",
    "top_k": "Top-k sampling filter (0 = off); none = the bundle's default.",
    "top_p": "Top-p (nucleus) filter, in (0, 1]; none = the bundle's default.",
    "cfg_scale": "Classifier-free guidance scale (>= 1; 1 runs no unconditional row); none = the bundle's default.",
    "tree": "Draft tree of methods eagle2 and static (adt shapes its own trees: decode.adaptive). All three of "
            "depth, top_k, budget unset: eagle2 sizes its tree for this device from the measured costs and "
            "acceptance (within decode.adaptive's d_max and n_max); any one set fixes it by hand, the others "
            "taking EAGLE-2's 5, 10, 58.",
    "tree.depth": "Draft levels per round (eagle2; static trees are cut to this depth); none = sized for the device.",
    "tree.top_k": "Children expanded per node and frontier size per level (eagle2); none = sized for the device.",
    "tree.budget": "Draft nodes kept after reranking, verified per round (eagle2); none = sized for the device.",
    "tree.static_paths": "Method static: the fixed tree as a list of paths of child ranks, e.g. [[0], [1], [0, 0]] = "
                         "two children of the root and one grandchild under the first (every path's parent listed); "
                         "none = a built-in 25-node, 5-level tree.",
    "adaptive": "ADT-Tree controller, methods adt and jacobi (docs/adt_tree.md).",
    "adaptive.d0": "Depth of a round with no adjacent record to start from.",
    "adaptive.k0": "Width (top-k) of a round with no adjacent record to start from.",
    "adaptive.beta": "Acceptance ratio (accepted / depth of the adjacent round) at or above which a tree grows "
                     "deeper and narrower; below it, shallower and wider.",
    "adaptive.d_min": "Smallest tree depth.",
    "adaptive.d_max": "Largest tree depth.",
    "adaptive.k_min": "Smallest tree width.",
    "adaptive.k_max": "Largest tree width.",
    "adaptive.n_min": "Fewest draft nodes per round (budget shape).",
    "adaptive.n_max": "Most draft nodes per round (budget shape; also sizes the verify forward's widest tree).",
    "adaptive.gamma": "Budget shape: n = clamp(round(gamma * depth * width), n_min, n_max) nodes per round.",
    "adaptive.init": "Adjacent record a round starts from: horizontal (left neighbour, else the one above), vertical "
                     "(above first), both (horizontal, its acceptance averaged with the row above).",
    "adaptive.mode": "How a shape moves: bisect (halfway to the bound) or step (by l_d and l_k).",
    "adaptive.l_d": "Depth step of mode step.",
    "adaptive.l_k": "Width step of mode step.",
    "adaptive.budget": "cost = the batch cost budget sizes every round from this device's measured forward costs "
                       "and drafts only where it pays; shape = the paper's n = gamma * depth * width trees.",
    "lantern": "LANTERN relaxed acceptance: lossy (images may leave the target's distribution); none = exact.",
    "lantern.k": "Nearest codebook neighbours of a token that a relaxed acceptance may take instead.",
    "lantern.delta": "LANTERN: total-variation budget per draft node (the committed token stays within delta of the "
                     "target's distribution).",
    "lantern.lam": "LANTERN++ instead of delta: each neighbour set may hold (lam - 1) p(x) of mass; none = LANTERN.",
    "sampler": "coupled = Gumbel noise fixed per (seed, position, token): every method and batch gives AR's image for "
               "the same seed; rejection = recursive rejection sampling (same law, other images). Ignored when greedy.",
    "draft_score": "Path score of coupled drafts for reranking and the cost budget (docs/adt_tree.md).",
    "batch_size": "Images in flight per actor (one engine, continuous refill; every method).",
    "dtype": "Model compute dtype.",
    "max_tokens": "Stop after this many image tokens (tests / calibration only; the rest of the grid is token 0); "
                  "none = the whole grid.",
}


class EngineFieldError(ValueError):
    """The engine refused a value: `field` is its dotted name under decode ('' when unknown)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.message = field, message


_RULE = re.compile(r"^(?P<field>[a-z_][\w.]*) must be (?P<rule>.+), got (?P<got>.+)$", re.S)


def engine_field_error(err: Exception) -> EngineFieldError:
    """The engine's message ('tree.depth must be an integer >= 1, got 0') split into field and rule."""
    text = str(err).strip()
    m = _RULE.match(text)
    if m:
        return EngineFieldError(m["field"], f"must be {m['rule']} (got {m['got']})")
    if text.startswith("static path"):  # TreeConfig's path checks
        return EngineFieldError("tree.static_paths", text)
    return EngineFieldError("", text)


class _Section(BaseModel):
    # Unknown keys are typos: refuse them instead of silently ignoring a setting.
    model_config = ConfigDict(extra="forbid", validate_default=True)


class SubSection(_Section):
    """A nested engine config (tree, adaptive, lantern): its fields are options, and the
    command line also takes it whole, as one JSON object."""


class _DecodeBase(_Section):
    """Decoding settings: adt_core.config.DecodeConfig less `device` (set per actor)."""

    @model_validator(mode="after")
    def _engine_accepts(self) -> "_DecodeBase":
        self.engine_config("cpu")  # the engine's own rules, once, at validation
        return self

    def engine_config(self, device: str, **changes: Any) -> DecodeConfig:
        """The engine's DecodeConfig on `device`, with `changes` (e.g. method='ar') applied."""
        try:
            return DecodeConfig.from_dict({**self.model_dump(), "device": device, **changes})
        except (ValueError, TypeError) as e:
            raise engine_field_error(e) from None


def _doc(dotted: str, f: Optional[dataclasses.Field] = None) -> str:
    """A field's help: the engine's own (dataclass metadata "doc") when it has one, else ours;
    an undocumented engine field fails test_job_config."""
    return (f.metadata.get("doc") if f is not None else None) or FIELD_DOCS.get(dotted, "")


def _annotation(tp: Any, dotted: str) -> Any:
    """The pydantic type of one engine field: nested dataclasses become sections, listed
    string choices become Literals."""
    args = typing.get_args(tp)
    if type(None) in args:  # X | None
        inner = [a for a in args if a is not type(None)]
        return Optional[_annotation(inner[0], dotted)] if len(inner) == 1 else tp
    if dataclasses.is_dataclass(tp):
        return section(tp, dotted + ".")
    if dotted in CHOICES:
        return Literal[CHOICES[dotted]]
    return tp


def section(cls: type, prefix: str = "") -> type[_Section]:
    """A pydantic model with the fields, defaults and types of the engine dataclass `cls`
    (`prefix`: its dotted place under decode, '' for DecodeConfig itself)."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in SKIPPED and not prefix:
            continue
        dotted = prefix + f.name
        tp, doc = _annotation(hints[f.name], dotted), _doc(dotted, f)
        if f.default is not dataclasses.MISSING:
            info = Field(f.default, description=doc)
        elif dataclasses.is_dataclass(f.default_factory):  # a nested config: its section's defaults
            info = Field(default_factory=typing.get_args(tp)[0] if typing.get_args(tp) else tp, description=doc)
        else:
            info = Field(default_factory=f.default_factory, description=doc)
        fields[f.name] = (tp, info)
    base = SubSection if prefix else _DecodeBase
    return create_model(cls.__name__.removesuffix("Config") + "Section", __base__=base,
                        __doc__=_doc(prefix.rstrip(".")) or base.__doc__, **fields)


DecodeSection = section(DecodeConfig)
