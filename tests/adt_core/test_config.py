"""DecodeConfig and its sub-configs refuse bad values where they are built, naming the field."""

import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, LanternConfig, TreeConfig
from adt_core.config import SamplingConfig


@pytest.mark.parametrize("build,field", [
    (lambda: LanternConfig(k=-5), "lantern.k"),
    (lambda: LanternConfig(delta=-1), "lantern.delta"),
    (lambda: LanternConfig(lam=-3), "lantern.lam"),
    (lambda: AdaptiveConfig(budget="bogus"), "adaptive.budget"),
    (lambda: AdaptiveConfig(d_min=6, d_max=3), "adaptive.d_min"),
    (lambda: AdaptiveConfig(k0=-1), "adaptive.k0"),
    (lambda: AdaptiveConfig(init="horizontl"), "adaptive.init"),
    (lambda: AdaptiveConfig(mode="bisection"), "adaptive.mode"),
    (lambda: AdaptiveConfig(beta=1.5), "adaptive.beta"),
    (lambda: TreeConfig(depth=0), "tree.depth"),
    (lambda: TreeConfig(top_k=2.5), "tree.top_k"),
    (lambda: SamplingConfig(temperature=float("inf")), "temperature"),
    (lambda: SamplingConfig(top_p=0.0), "top_p"),
    (lambda: DecodeConfig(temperature=float("nan")), "temperature"),
    (lambda: DecodeConfig(sampler="gumbel"), "sampler"),
    (lambda: DecodeConfig(draft_score="x"), "draft_score"),
    (lambda: DecodeConfig(method="medusa"), "method"),
    (lambda: DecodeConfig.from_dict({"adaptive": {"d_min": 9}}), "adaptive.d_min"),
])
def test_bad_values_name_their_field(build, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        build()


def test_torch_dtype_accepted():
    assert DecodeConfig(dtype=torch.bfloat16).dtype == "bfloat16"
    assert DecodeConfig(dtype=torch.float32) == DecodeConfig(dtype="float32")
    assert DecodeConfig(dtype=torch.float32).config_hash() == DecodeConfig().config_hash()


def test_round_trip_keeps_sampler():
    c = DecodeConfig(method="adt", sampler="rejection", draft_score="logq", adaptive=AdaptiveConfig(budget="cost"))
    assert DecodeConfig.from_dict(c.to_dict()) == c
