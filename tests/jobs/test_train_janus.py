"""A Janus drafter trained by jobs.train_drafter's own training code, exported as a bundle
component, then every method equals `ar` token for token.

Tiny random Janus-Pro checkpoint in the published layout (tests/adt_core/janus_fixtures.py: Llama
64 wide, 2 layers, 64 codes, 4 x 4 grid). The data is the target's own `ar` images at the
bundle's defaults (what the job's data step asks the batch job for; the batch job itself runs on
a Janus bundle in tests/pipeline/test_janus_job.py). Training runs `jobs.train.ray_train.train_loop`,
the loop every Ray Train worker runs, in this process (one worker, no Ray: Ray Train's start-up
would cost more than the whole test); export is the job's `export` (OUT/drafter, OUT/bundle).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adt_core"))
from janus_fixtures import GRID, make_hf_janus, make_tokenizer, save_published  # noqa: E402

from adt_core import AdaptiveConfig, DecodeConfig, Generator, TreeConfig, load_bundle  # noqa: E402
from adt_core.bundles.family_bundle import write_family_bundle  # noqa: E402
from adt_core.calibrate import CostTable  # noqa: E402
from adt_core.config import SamplingConfig  # noqa: E402
from adt_core.families.janus.prompt import JANUS_SAMPLING  # noqa: E402
from adt_core.round.sampling import cfg_mix  # noqa: E402

STEPS = 30
PROMPTS = [("a tiny prompt " * (1 + i % 3)) + str(i) for i in range(8)]  # ragged prompt rows
EVAL = ["an apple", "a dog on the grass at night", "sun"]  # ragged prompt rows
SEEDS = [3, 1, 4]
COSTS = CostTable({1: 1.0, 4: 1.2, 8: 1.5, 16: 2.5, 32: 5.0, 64: 10.0, 128: 20.0}, draft_level_ms=0.2,
                  draft={1: 0.2, 64: 0.4, 256: 1.0})
METHODS = [
    ("static", dict(tree=TreeConfig(depth=3))),
    ("eagle2", dict(tree=TreeConfig(depth=3, top_k=3, budget=8))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="shape", d_max=4, k_max=4, n_max=12))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="cost", d_max=4, k_max=4, n_max=12))),
]


def janus_bundle_dir(root: Path, drafter: str | None = None) -> Path:
    """A Janus family bundle: the published checkpoint directory is target, VQ and tokenizer."""
    save_published(make_hf_janus(seed=2), root / "target")
    make_tokenizer(root / "target" / "tokenizer.json")
    comps = {"target": "target", "vq": "target", "tokenizer": "target", "drafter": drafter}
    return write_family_bundle(root, "tiny-janus", "janus", comps, {"grid": GRID}, SamplingConfig(**JANUS_SAMPLING))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    pytest.importorskip("transformers.models.janus", reason="transformers >= 4.52 has models/janus")
    return janus_bundle_dir(tmp_path_factory.mktemp("janus_src"))


def own_images(bundle, temperature=None):
    """The target's own grids for PROMPTS x 3 seeds (ar, the bundle's defaults unless given)."""
    prompts = PROMPTS * 3
    res = Generator(bundle, DecodeConfig(method="ar", batch_size=8, temperature=temperature)).generate(
        prompts, list(range(len(prompts))))
    return torch.stack([r.tokens.flatten() for r in res]), np.arange(len(prompts)) % len(PROMPTS)


@pytest.fixture(scope="module")
def trained(source, tmp_path_factory):
    """(OUT, state): STEPS steps of the job's training loop, exported by the job's export."""
    from jobs import train_drafter
    from jobs.train.heads import HEADS, family_of
    from jobs.train.distill import GridSet, worker_arrays
    from jobs.train.eval import drafter_from_state
    from jobs.train.ray_train import Shard, train_loop
    from pipeline.storage import open_storage

    bundle = load_bundle(source)
    assert family_of(bundle) == "janus"
    tokens, prompt = own_images(bundle)
    grids = GridSet([f"p{i}" for i in range(len(tokens))], list(range(len(tokens))), tokens,
                    torch.from_numpy(prompt), PROMPTS, (GRID, GRID), 0)
    rows = HEADS["janus"].prompt_arrays(bundle, PROMPTS, say=lambda _: None)
    out_dir = tmp_path_factory.mktemp("janus_train") / "out"
    cfg = train_drafter.load_config(None, {"bundle": str(source), "data": str(out_dir / "data"), "out": str(out_dir),
                                           "train": {"steps": STEPS, "batch_size": 8, "warmup": 2, "log_every": 10,
                                                     "ckpt_every": 10, "eval_every": 0, "lr": 3e-3}})
    reports = []
    state = train_loop({"train": cfg.train.model_dump(), "family": "janus"}, bundle.target,
                       Shard(worker_arrays(grids, rows)), None, torch.device("cpu"),
                       report=lambda metrics, st: reports.append((metrics["step"], st is not None)))
    assert reports == [(10, True), (20, True), (30, True)] and state["step"] == STEPS
    drafter = drafter_from_state(state, "janus", bundle.target)
    written = train_drafter.export(cfg, open_storage(str(out_dir)), bundle, drafter, {"job": "test"}, "janus")
    assert set(written) == {"drafter", "bundle"}
    return out_dir, state


def test_teacher_forced_pairs_line_up_with_the_engine(source):
    """On greedy CFG data, the CFG mix of head(h) at pair j is code j + 1 (h: the target's
    state the training pairs regress), for every ragged prompt row."""
    from jobs.train.heads import HEADS
    from jobs.train.ray_train import Shard
    from adt_core.families.janus.drafter import new_drafter

    bundle = load_bundle(source)
    tokens, prompt = own_images(bundle, temperature=0.0)
    rows = HEADS["janus"].prompt_arrays(bundle, PROMPTS, say=lambda _: None)
    images = torch.tensor([i for i in range(len(PROMPTS)) if i % 3 != 2])  # not the longest prompts
    codes, batch = Shard({"tokens": tokens.numpy(), "prompt": prompt, **rows}).batch(images, "cpu")
    lengths = batch["lengths"][:, 0]
    assert len(set(lengths.tolist())) > 1 and int(lengths.max()) < rows["ids"].shape[-1]  # ragged, padded wider
    with torch.no_grad():
        f, h = HEADS["janus"].pairs(bundle.target, new_drafter(bundle.target, seed=0), codes, batch, torch.device("cpu"),
                                    "fp32", 0.0, None)
    assert f.shape == h.shape == (2 * len(images), GRID * GRID - 1, 64)
    mixed = cfg_mix(bundle.target.head(h), JANUS_SAMPLING["cfg_scale"])  # (B, L-1, V)
    assert torch.equal(mixed.argmax(-1), codes[:, 1:])


def test_export_is_a_janus_drafter_component(trained, source):
    out, state = trained
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["model_type"] == "janus_eagle_drafter" and cfg["num_hidden_layers"] == 1
    weights = load_file(str(out / "drafter" / "model.safetensors"))
    assert len(weights) == 10 and all(v.dtype == torch.float16 for v in weights.values())
    meta = json.loads((out / "bundle" / "bundle.json").read_text())
    assert meta["family"] == "janus" and meta["components"] == {"target": "target", "vq": "target",
                                                                 "tokenizer": "target", "drafter": "drafter"}
    assert not (out / "bundle" / "vq").exists()  # a shared directory is copied once
    bundle = load_bundle(out / "bundle")
    for k, v in bundle.drafter.state_dict().items():
        torch.testing.assert_close(v, state["model"][k].half().float())
    assert state["metrics"][-1]["top1_agree"] > state["metrics"][0]["top1_agree"]


@pytest.fixture(scope="module")
def exported(trained):
    return load_bundle(trained[0] / "bundle")


def run(bundle, method, bs, **kw):
    g = Generator(bundle, DecodeConfig(method=method, batch_size=bs, **kw))
    g.use_costs(COSTS)
    return torch.stack([r.tokens.flatten() for r in g.generate(EVAL, SEEDS)]), g


@pytest.mark.parametrize("temperature", [0.0, None], ids=["greedy", "coupled-defaults"])
def test_every_method_equals_ar(exported, temperature):
    """Greedy (T 0) and coupled at Janus' defaults (T 1, CFG 5, no top-k), batch 1 and 3."""
    ref, g = run(exported, "ar", 1, temperature=temperature)
    assert g.sampling.cfg_scale == 5.0 and g.sampling.temperature == (1.0 if temperature is None else 0.0)
    for method, extra in METHODS:
        for bs in (1, 3):
            got, g = run(exported, method, bs, temperature=temperature, **extra)
            assert torch.equal(got, ref), (method, extra, bs)
    res = Generator(exported, DecodeConfig(method="eagle2", batch_size=3, temperature=temperature,
                                           tree=TreeConfig(depth=3, top_k=3, budget=8))).generate(EVAL, SEEDS)
    accepted = sum(r.stats.accepted_draft_tokens for r in res)
    assert accepted > 0  # the trained drafter is accepted: the accepted-path code ran
    f = exported.vq.downsample_factor
    assert torch.equal(torch.stack([r.tokens.flatten() for r in res]), ref)
    assert all(r.image.shape == (GRID * f, GRID * f, 3) for r in res)


@pytest.mark.parametrize("where", ["local", "hub-cache"])
def test_a_manifest_names_the_exported_drafter(trained, source, where, tmp_path, monkeypatch):
    """A Janus manifest whose drafter entry is the job's OUT/drafter, as a local path or as
    hf:// in huggingface_hub's cache layout (offline), loads it for the manifest's target."""
    import yaml
    from huggingface_hub import constants

    from test_hub_cache import put_in_hub_cache

    out, state = trained
    drafter = str(out / "drafter")
    if where == "hub-cache":
        hub_dir = tmp_path / "hf_home" / "hub"
        put_in_hub_cache(hub_dir, "org/janus-drafter", {f.name: f for f in (out / "drafter").iterdir()})
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_dir))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        drafter = "hf://org/janus-drafter/"
    target = str(source / "target")
    manifest = {"name": "tiny-janus-manifest", "family": "janus", "grid": GRID, "target": {"path": target},
                "vq": {"path": target}, "tokenizer": {"path": target}, "drafter": {"path": drafter},
                "sampling": JANUS_SAMPLING, "dtype": "float32"}
    path = tmp_path / "janus.yaml"
    path.write_text(yaml.safe_dump(manifest))
    bundle = load_bundle(path)
    assert type(bundle.drafter).__name__ == "JanusDrafter" and bundle.drafter.target is bundle.target
    for k, v in bundle.drafter.state_dict().items():
        torch.testing.assert_close(v, state["model"][k].half().float())
