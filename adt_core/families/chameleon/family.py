"""Chameleon's registry entry (Anole, Lumina-mGPT): its parts in their published layouts."""

from adt_core.families.chameleon.drafter import load_chameleon_drafter
from adt_core.families.chameleon.model import load_chameleon
from adt_core.families.chameleon.prompt import load_prompter
from adt_core.families.chameleon.vq import load_chameleon_vq
from adt_core.families.registry import Family

FAMILY = Family("chameleon", load_chameleon, load_chameleon_drafter, load_chameleon_vq, load_prompter)
