"""LlamaGen's registry entry. Its bundle directories and manifests name its own config files
(adt_core/bundles/bundle.py, manifest.py), so it has no published-layout part loaders."""

from adt_core.families.registry import Family

FAMILY = Family("llamagen", train_head="captions")
