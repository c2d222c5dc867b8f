"""Which planner a method runs: the one dispatch on `DecodeConfig.method` for the round's plan and
its cache extent (the decoder builds the planner; adt_core/memory.py reads the class's extent)."""

from __future__ import annotations

from adt_core.calibrate import CostTable
from adt_core.config import DecodeConfig
from adt_core.round.adaptive import AdaptiveGrid
from adt_core.round.cost_plan import CostPlanner
from adt_core.round.eagle_plan import SizedEaglePlanner
from adt_core.round.jacobi_plan import JacobiPlanner
from adt_core.round.plan import EaglePlanner, Planner, ShapePlanner, StaticPlanner
from adt_core.round.state import Extent


def planner_class(config: DecodeConfig) -> type[Planner]:
    """The method's planner class: adt and jacobi share ADT-Tree's shapes; their cost budgets differ."""
    if config.method == "ar":
        return Planner
    if config.method == "eagle2":
        return SizedEaglePlanner if config.tree.sized else EaglePlanner
    if config.method == "static":
        return StaticPlanner
    if config.adaptive.budget == "cost":
        return JacobiPlanner if config.method == "jacobi" else CostPlanner
    return ShapePlanner


def planner_for(config: DecodeConfig, n_tokens: int, grid: AdaptiveGrid | None, costs: CostTable | None,
                capacity: int) -> Planner:
    """The method's planner, picked once per decoder."""
    return planner_class(config).build(config, n_tokens, grid, costs, capacity)


def extent(config: DecodeConfig) -> Extent:
    """The method's cache extent (its planner class's)."""
    return planner_class(config).extent(config)
