"""A tiny Chameleon bundle directory in the real layouts (tests/adt_core/chameleon_fixtures.py):
loading on the meta device (every file checked, no weights), the memory plan against what the
decoder really allocates, and LANTERN's relaxation with the neighbour table shipped in the
drafter directory (row = code = id - 4), still labelled lossy."""

import numpy as np
import pytest
import torch

from adt_core import DecodeConfig, Generator, LanternConfig, TreeConfig, load_bundle
from adt_core.calibrate import CostTable
from adt_core.families.weights import CheckpointError
from adt_core.memory import GB, bundle_plan

CODES = 8192
COSTS = CostTable({1: 1.0, 8: 1.5, 64: 10.0}, draft_level_ms=0.2, draft={1: 0.2, 64: 0.4})


def shifted_table(k: int = 8) -> np.ndarray:
    """Row c: codes c + 1 .. c + k (mod V): a table no codebook would give, so its use shows
    (the one the `anole_dir` fixture of conftest.py ships in its drafter directory)."""
    return ((np.arange(CODES)[:, None] + 1 + np.arange(k)[None]) % CODES).astype(np.uint16)


def test_meta_load_checks_every_part_and_reads_no_weights(anole_dir):
    bundle = load_bundle(anole_dir, device="meta")
    for part in (bundle.target, bundle.drafter, bundle.vq):
        assert all(p.device.type == "meta" for p in part.parameters())
    assert bundle.neighbours == anole_dir / "drafter" / "top_8191_indices.npy"  # found in the drafter folder
    real = load_bundle(anole_dir)
    assert bundle.component_bytes() == real.component_bytes()


def test_meta_load_names_a_misshapen_drafter_tensor(anole_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    import shutil

    broken = tmp_path / "b"
    shutil.copytree(anole_dir, broken)
    f = broken / "drafter" / "model.safetensors"
    state = load_file(str(f))
    state["fc.bias"] = state["fc.bias"][:-1].contiguous()
    save_file(state, str(f))
    with pytest.raises(CheckpointError, match=r"misshaped keys: fc.bias \(63,\) \(expected \(64,\)\)"):
        load_bundle(broken, device="meta")


@pytest.mark.parametrize("method,cfg_scale", [("ar", 3.0), ("eagle2", 1.0), ("adt", 3.0)])
def test_plan_is_what_the_decoder_allocates(anole_dir, method, cfg_scale):
    bundle = load_bundle(anole_dir)
    config = DecodeConfig(method=method, temperature=0.0, cfg_scale=cfg_scale, batch_size=3)
    plan = bundle_plan(bundle, config, 1 * GB, reserve_fraction=0.0)
    gen = Generator(bundle, config)
    gen.use_costs(COSTS)  # adt's cost budget: no measurement here
    dec = gen.decoder(3)
    assert dec.cache.k.shape[1] == plan.rows_per_image * 3 and dec.cache.k.shape[3] == plan.tokens_per_row
    k = dec.cache.k
    assert plan.target_kv_per_image == 2 * k[:, :plan.rows_per_image].numel() * 4  # fp32 here
    if method != "ar":
        d = dec.drafter.cache.k
        assert plan.drafter_kv_per_image == 2 * d[:, :plan.rows_per_image].numel() * 4
    assert plan.images == 3 and plan.fits > 3


def test_lantern_reads_the_drafters_neighbour_table(anole_dir):
    bundle = load_bundle(anole_dir)
    base = dict(method="eagle2", temperature=1.0, top_k=50, cfg_scale=3.0, batch_size=2, max_tokens=48,
                tree=TreeConfig(depth=2, top_k=2, budget=4))
    gen = Generator(bundle, DecodeConfig(**base, lantern=LanternConfig(k=4, delta=0.3)))
    gen.use_costs(COSTS)  # no cost measurement here
    relax = gen.relaxation()
    assert torch.equal(relax.neighbours, torch.from_numpy(shifted_table()[:, :4].astype(np.int64)))
    assert relax.delta == 0.3
    results = gen.generate(["an apple", "sun"], [1, 2])
    assert all(r.stats.lossy for r in results)
    exact = Generator(bundle, DecodeConfig(**base))
    exact.use_costs(COSTS)
    assert not exact.generate(["sun"], [2])[0].stats.lossy


def test_a_table_for_another_codebook_is_refused(anole_dir, tmp_path):
    bundle = load_bundle(anole_dir)
    bad = tmp_path / "top_63_indices.npy"
    np.save(bad, shifted_table()[:64] % 64)
    bundle.neighbours = bad
    with pytest.raises(CheckpointError, match="64 rows, the codebook has 8192"):
        bundle.neighbour_table(4)


def test_max_prompt_bounds_the_plan_and_a_longer_prompt_fails_alone(anole_dir):
    from adt_core.families.chameleon.prompt import load_prompter
    from adt_core.results import PromptFailure

    bundle = load_bundle(anole_dir)
    bundle.prompter = load_prompter(anole_dir / "target", layout="anole", max_prompt=16)
    config = DecodeConfig(method="ar", temperature=0.0, batch_size=2, max_tokens=4)
    plan = bundle_plan(bundle, config, 1 * GB)
    assert plan.tokens_per_row == 16 + 4 + 2  # prompt budget + the codes decoded + 2
    gen = Generator(bundle, config)
    assert gen.decoder(2).cache.k.shape[3] == plan.tokens_per_row
    out = dict(gen.stream(["an apple", "an " * 40], [1, 2]))
    assert not isinstance(out[0], PromptFailure)
    assert isinstance(out[1], PromptFailure) and "the bundle holds 16 (prompt.max_prompt)" in str(out[1].error)
