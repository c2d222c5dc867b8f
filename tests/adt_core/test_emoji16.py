"""The embedded emoji16 bundle: it loads offline, its text encoder is deterministic, and greedy
decoding reproduces the token grid stored at export (weights, RoPE, masks, CFG, sampling)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from adt_core import AdaptiveConfig, DecodeConfig, Generator, load_bundle
from adt_core.bundles.bundle import EMBEDDED_DIR
from jobs.train.reference import greedy_margins

BUNDLE = EMBEDDED_DIR / "emoji16"
REFERENCE = json.loads((BUNDLE / "reference.json").read_text())


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("emoji16")


def test_bundle_is_small_and_half_precision():
    files = [p for p in BUNDLE.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 60e6
    weights = sorted(p.relative_to(BUNDLE).as_posix() for p in files if p.suffix == ".safetensors")
    assert weights == ["drafter/model.safetensors", "target/model.safetensors", "vq/model.safetensors"]
    for name in weights:
        with safe_open(BUNDLE / name, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} <= {"F16", "BF16", "I64", "BOOL"}


def test_loads_offline_in_a_fresh_process(tmp_path):
    """No hub, no cache, and any HTTP attempt would hit a closed loopback port."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    code = ("from adt_core import load_bundle; b = load_bundle(); c, m = b.text_encoder.encode(['red heart']);"
            "print(b.name, b.grid, tuple(c.shape), b.target.config.vocab_size, b.drafter is not None)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "emoji16 (16, 16) (1, 32, 384) 1024 True"
    assert not (tmp_path / "hf" / "hub").exists()


def test_text_encoder_is_deterministic(bundle):
    enc = bundle.text_encoder
    prompts = ["an emoji of a grinning face", "red heart", "a slice of pizza with pepperoni and a very long caption"]
    a, ma = enc.encode(prompts)
    b, mb = enc.encode(prompts)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    for i, p in enumerate(prompts):  # alone == inside a batch; valid rows sit at the end
        one, m1 = enc.encode([p])
        assert torch.equal(m1[0], ma[i])
        torch.testing.assert_close(one[0], a[i], atol=1e-5, rtol=1e-5)
        n = int(ma[i].sum())
        assert ma[i, -n:].all() and not ma[i, :-n].any()
        assert (a[i, ~ma[i]] == 0).all()


def test_stored_grid_is_the_teacher_forced_argmax(bundle):
    """One forward over the stored grid: every stored token is the guided argmax (a clear
    failure message before the cascade of a full regeneration)."""
    tokens = torch.tensor(REFERENCE["tokens"]).flatten()
    margins = greedy_margins(bundle, REFERENCE["prompt"], tokens, REFERENCE["cfg_scale"])
    assert bool((margins >= 0).all()), f"stored tokens no longer the argmax at {torch.nonzero(margins < 0).flatten().tolist()}"
    assert float(margins.min()) == pytest.approx(REFERENCE["min_margin"], abs=1e-2)


@pytest.mark.parametrize("method", ["ar", "eagle2", "adt"])
def test_greedy_generation_reproduces_the_stored_grid(bundle, method):
    # the paper's fixed-shape budget: drafts every round whatever this machine's timings
    cfg = DecodeConfig(method=method, temperature=0.0, adaptive=AdaptiveConfig(budget="shape"))
    out = Generator(bundle, cfg).generate([REFERENCE["prompt"]], [REFERENCE["seed"]])[0]
    assert out.tokens.tolist() == REFERENCE["tokens"]
    if method != "ar":
        assert out.stats.mean_acceptance_length > 1.5  # the drafter really predicts its target
