"""The family registry: every entry resolves to its declared Family, and a family defined outside
adt_core registers with one call (no production file changed)."""

import pytest

from adt_core.families import registry
from adt_core.families.registry import Family, family_names, get_family, register, unregister


@pytest.mark.parametrize("name", family_names())
def test_every_registered_family_resolves_to_its_entry(name):
    fam = get_family(name)
    assert isinstance(fam, Family) and fam.name == name


def test_a_family_from_outside_registers_with_one_call():
    toy = Family("toy", train_head=None)
    register("toy", toy)
    try:
        assert "toy" in family_names() and get_family("toy") is toy
    finally:
        unregister("toy")
    with pytest.raises(KeyError, match="unknown model family 'toy'"):
        get_family("toy")
    assert "toy" not in registry._FAMILIES


def test_training_heads_are_read_from_the_family():
    from adt_core import random_bundle
    from jobs.train.heads import HEADS, family_of

    assert family_of(random_bundle(vocab=16, grid=(2, 2))) == "llamagen" and "llamagen" in HEADS
    assert get_family("janus").train_head == "tokens" and get_family("chameleon").train_head is None
