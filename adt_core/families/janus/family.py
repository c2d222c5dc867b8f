"""Janus-Pro's registry entry: its parts in their published layouts; drafters train on token rows."""

from adt_core.families.janus.drafter import load_janus_drafter
from adt_core.families.janus.prompt import load_prompter
from adt_core.families.janus.weights import load_janus, load_janus_vq
from adt_core.families.registry import Family

FAMILY = Family("janus", load_janus, load_janus_drafter, load_janus_vq, load_prompter, train_head="tokens")
