"""adt_core: exact speculative decoding (EAGLE-2, static and ADT-Tree draft trees, Jacobi windows)
for visual autoregressive models of any registered family (adt_core/families/registry.py:
LlamaGen, Chameleon, Janus). Torch only: no Ray, no storage."""

from adt_core.bundles.bundle import Bundle, random_bundle, save_bundle
from adt_core.bundles.loader import load_bundle
from adt_core.config import AdaptiveConfig, DecodeConfig, LanternConfig, SamplingConfig, TreeConfig
from adt_core.engine import Generator
from adt_core.results import GenerationResult, PromptFailure, RoundTrace, StepStats

__all__ = [
    "AdaptiveConfig", "Bundle", "DecodeConfig", "GenerationResult", "Generator", "LanternConfig",
    "PromptFailure", "RoundTrace", "SamplingConfig", "StepStats", "TreeConfig", "load_bundle", "random_bundle", "save_bundle",
]
