"""A LlamaGen manifest's `drafter:` may name jobs.train_drafter's export (OUT/drafter: DrafterConfig
fields in config.json + fp16 safetensors), not only a LANTERN checkpoint: the manifest's drafter
loader (`drafter_checkpoints.load_lantern_drafter`, which bundles/manifest.py calls for that entry) reads
it for the manifest's target and refuses one made for another target. (A Janus manifest's
drafter entry is the Janus family's own format: tests/jobs/test_train_janus.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from adt_core import random_bundle
from adt_core.families.llamagen.drafter_weights import load_lantern_drafter
from adt_core.families.weights import CheckpointError


def test_the_manifest_drafter_loader_reads_the_jobs_export(tmp_path):
    from jobs import train_drafter
    from pipeline.storage import open_storage

    bundle = random_bundle(seed=0)
    out = tmp_path / "out"
    cfg = train_drafter.load_config(None, {"bundle": "random:0", "data": "d", "out": str(out)})
    train_drafter.export(cfg, open_storage(str(out)), bundle, bundle.drafter, {"job": "test"})
    loaded = load_lantern_drafter(out / "drafter", bundle.target.config)
    assert loaded.config == bundle.drafter.config and not loaded.config.caption_pairs
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, bundle.drafter.state_dict()[k].half().float())
    other = dict(bundle.drafter.config.to_dict(), grid_h=4)  # a drafter for another grid
    (out / "drafter" / "config.json").write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match="does not match the target"):
        load_lantern_drafter(out / "drafter", bundle.target.config)
