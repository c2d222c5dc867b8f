"""Memory plan with the real 7B shapes (no weights): Lumina-mGPT-7B-768 and Anole-7B with their
LANTERN drafters on an 80 GB and a 141 GB device."""

import pytest

from adt_core.families.chameleon.drafter import ChameleonDrafter
from adt_core.families.chameleon.model import ChameleonConfig, ChameleonTarget
from adt_core.families.chameleon.vq import ChameleonVQ, VQGANConfig
from adt_core.families.contract import Layout
from adt_core.memory import GB, KVShape, MemoryPlanError, module_bytes, plan_memory

PROMPT = 160  # prompt budget per row (template + prompt + image head)
TREE, DEPTH = 58, 5
LUMINA = Layout(48, 48, head=(8197, 8828, 8828), eol=8803, end=8196)  # 768 px
ANOLE = Layout(32, 32, head=(8197,), end=8196)  # 512 px


@pytest.fixture(scope="module")
def seven_b():
    cfg = ChameleonConfig.chameleon_7b()
    drafter = ChameleonConfig.chameleon_7b(num_hidden_layers=1)
    weights = {"target": module_bytes(lambda: ChameleonTarget(cfg), 2),
               "drafter": module_bytes(lambda: ChameleonDrafter(drafter), 2),
               "vqgan": module_bytes(lambda: ChameleonVQ(VQGANConfig()), 4)}
    return cfg, weights


def _plan(seven_b, layout, device, batch_size=64):
    cfg, weights = seven_b
    workspace = VQGANConfig().decode_bytes(layout.grid_h * 16, layout.grid_w * 16)  # one image at a time
    kv = KVShape(cfg.num_hidden_layers, cfg.kv_width)
    return plan_memory(device, weights, kv, PROMPT + layout.length, cfg=True, dtype_bytes=2,
                       drafter=KVShape(1, cfg.kv_width), tree_nodes=TREE, tree_depth=DEPTH,
                       logits_width=cfg.num_image_codes, workspace_bytes=int(workspace), batch_size=batch_size)


def test_7b_weights(seven_b):
    _, w = seven_b
    assert 13.4 * GB < w["target"] < 13.7 * GB  # bf16, lm_head kept for the 8192 image codes only
    assert 1.0 * GB < w["drafter"] < 1.02 * GB  # 16 tensors, the embedding copy is half of it
    assert 0.2 * GB < w["vqgan"] < 0.4 * GB


@pytest.mark.parametrize("device,expected", [(80 * GB, 20), (141 * GB, 40)])
def test_lumina_768(seven_b, device, expected):
    plan = _plan(seven_b, LUMINA, device)
    length = PROMPT + 48 * 49 + 1 + TREE + 1
    assert plan.tokens_per_row == length
    assert plan.target_kv_per_image == 2 * 32 * 2 * 4096 * length * 2  # ~2.7 GB with CFG
    free = device - int(device * 0.08) - sum(seven_b[1].values()) - 4 * 128 * 768 * 768 * 4
    assert plan.fits == free // plan.per_image == expected
    assert plan.images == expected  # under decode.batch_size 64
    text = plan.describe()
    assert f"{expected} images in flight on a {device / GB:.1f} GB device" in text and "per image" in text
    assert plan.to_dict()["per_image"] == plan.per_image


@pytest.mark.parametrize("device,fits,images", [(80 * GB, 42, 42), (141 * GB, 83, 64)])
def test_anole_512_and_the_batch_cap(seven_b, device, fits, images):
    plan = _plan(seven_b, ANOLE, device)
    assert (plan.fits, plan.images, plan.batch_size) == (fits, images, 64)
    assert _plan(seven_b, ANOLE, device, batch_size=None).images == fits


def test_one_image_that_does_not_fit_is_a_clear_error(seven_b):
    with pytest.raises(MemoryPlanError, match="not one image fits: the 16.0 GB device"):
        _plan(seven_b, LUMINA, 16 * GB)
    assert _plan(seven_b, LUMINA, 24 * GB).images == 2


def test_without_a_drafter_or_cfg():
    plan = plan_memory(10 * GB, {"target": 2 * GB}, KVShape(4, 256), 1000, cfg=False, logits_width=100,
                       reserve_fraction=0.0)
    assert plan.rows_per_image == 1 and plan.drafter_kv_per_image == 0
    assert plan.target_kv_per_image == 4 * 2 * 256 * 1000 * 2 and plan.tree_per_image == 400
    assert plan.fits == (8 * GB) // plan.per_image
    with pytest.raises(ValueError, match="batch_size 0"):
        plan_memory(10 * GB, {}, KVShape(1, 1), 1, batch_size=0)


# ---- the plan a job makes (adt_core.memory.bundle_plan) on a 7B bundle held on the meta device ----
@pytest.fixture(scope="module")
def meta_7b(tmp_path_factory):
    """Chameleon-7B target, its LANTERN drafter and Meta's VQGAN with the real shapes (meta device,
    no weights), and the family's prompters over a tokenizer with Chameleon's id layout."""
    import torch

    from adt_core.families.chameleon.prompt import load_prompter
    from chameleon_fixtures import make_tokenizer

    tok = make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    with torch.device("meta"):
        parts = (ChameleonTarget(ChameleonConfig.chameleon_7b()),
                 ChameleonDrafter(ChameleonConfig.chameleon_7b(num_hidden_layers=1)), ChameleonVQ(VQGANConfig()))
    return parts, {name: load_prompter(tok, layout=name) for name in ("lumina", "anole")}


@pytest.mark.parametrize("layout,device,method,expected", [
    ("lumina", 80, "eagle2", 18), ("lumina", 141, "eagle2", 36), ("lumina", 141, "ar", 37),
    ("anole", 80, "adt", 34), ("anole", 141, "adt", 64),  # Anole on 141 GB: memory fits 67, the cap is 64
])
def test_job_plan_of_7b_bundles(meta_7b, layout, device, method, expected):
    from adt_core import DecodeConfig
    from adt_core.bundles.bundle import Bundle
    from adt_core.config import SamplingConfig
    from adt_core.memory import bundle_plan
    from adt_core.round.planners import extent

    (target, drafter, vq), prompters = meta_7b
    p = prompters[layout]
    bundle = Bundle(f"{layout}-7b", None, target, drafter, vq, (p.layout.grid_h, p.layout.grid_w),
                    SamplingConfig(temperature=1.0, top_k=2000, cfg_scale=3.0), "chameleon", p)
    config = DecodeConfig(method=method, dtype="bfloat16")
    plan = bundle_plan(bundle, config, device * GB)
    assert plan.images == expected and plan.rows_per_image == 2
    assert plan.fits == {("anole", 141): 67}.get((layout, device), expected)
    assert 14.7 * GB < plan.weights_total < 15.0 * GB  # bf16 target + drafter, fp32 VQGAN
    span = p.layout.offset(p.layout.num_codes - 1) + 1  # 48 x 49 - 1 (Lumina), 1024 (Anole)
    e = extent(config)  # nodes: 0 (ar), 64 (eagle2 sized for the device, adt: the n_max bucket), held in
    room = e.nodes if e.room is None else e.room  # rows with room for 16 past the image's end (plan.ROOM)
    assert room == min(e.nodes, 16)
    assert plan.tokens_per_row == 512 + span + room + 2  # the engine's prompt budget + image + the tree's room
    assert f"{expected} image(s) in flight on a {device:.1f} GB device" in plan.line()
