"""Janus EAGLE drafter head: runs with the target's own input path (gen_embed + gen_aligner) and
head (gen_head), holds none of the target's weights, caches like one pass, and round-trips
through its 10-tensor checkpoint (strict)."""

import json

import pytest
import torch

from adt_core.families.contract import Drafter
from adt_core.families.registry import get_family
from adt_core.families.janus.model import JanusConfig, JanusTarget
from adt_core.families.weights import CheckpointError
from adt_core.families.janus.drafter import (
    NUM_TENSORS,
    JanusDrafter,
    JanusDrafterConfig,
    load_janus_drafter,
    new_drafter,
    save_janus_drafter,
)

TINY = JanusConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=300, num_image_codes=64, code_dim=8, head_width=96)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return JanusTarget(TINY).eval()


def _inputs(rows=2, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, TINY.num_image_codes, (rows, n), generator=g)
    hidden = torch.randn(rows, n, TINY.hidden_size, generator=g)
    positions = torch.arange(10, 10 + n)[None].expand(rows, -1)
    return codes, hidden, positions


@torch.no_grad()
def test_random_drafter_runs_on_the_targets_input_path_and_head(target):
    drafter = new_drafter(target, seed=1).eval()
    assert isinstance(drafter, Drafter)
    assert len(drafter.state_dict()) == NUM_TENSORS
    assert sorted(drafter.state_dict()) == sorted([
        "fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"])
    mine = {id(p) for p in drafter.parameters()}
    assert not mine & {id(p) for p in target.parameters()}  # the target is referenced, not owned

    codes, hidden, positions = _inputs()
    ids = target.vocab.to_id(codes)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    feats = drafter(ids, hidden, positions, causal)
    assert feats.shape == (2, 6, 64)
    logits = target.head(feats)
    assert logits.shape == (2, 6, TINY.num_image_codes) and logits.dtype == torch.float32

    # its token embedding is exactly gen_aligner(gen_embed(code))
    x = drafter.fc(torch.cat([target.gen_aligner(target.gen_embed(codes)), hidden], dim=-1))
    from adt_core.families.layers import half_rotary

    ref = drafter.layers[0](x, half_rotary(positions, 16, TINY.rope_theta), causal, None, 0)
    torch.testing.assert_close(feats, ref)

    cache = drafter.new_cache(2, 16)  # two cached steps == one pass
    a = drafter(ids[:, :4], hidden[:, :4], positions[:, :4], cache.attn_mask(causal[0, 0, :4, :4]), cache)
    b = drafter(ids[:, 4:], hidden[:, 4:], positions[:, 4:], cache.attn_mask(torch.ones(2, 2, dtype=torch.bool).tril()),
                cache)
    torch.testing.assert_close(torch.cat([a, b], dim=1), feats, atol=1e-5, rtol=1e-5)
    assert cache.k.shape[2] == 2  # kv heads of the target's shape


def test_training_step_touches_the_drafter_only(target):
    drafter = new_drafter(target, seed=2)
    for p in target.parameters():
        p.requires_grad_(False)
    codes, hidden, positions = _inputs(1, 5, seed=3)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    loss = target.head(drafter(target.vocab.to_id(codes), hidden, positions, causal)).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert all(p.grad is None for p in target.parameters())


@torch.no_grad()
def test_save_load_round_trip_and_strict_checks(tmp_path, target):
    drafter = new_drafter(target, seed=4).eval()
    d = save_janus_drafter(drafter, tmp_path / "fp32", dtype=torch.float32)
    assert json.loads((d / "config.json").read_text())["model_type"] == "janus_eagle_drafter"
    loaded = get_family("janus").load_drafter(d, target, dtype=torch.float32, device="cpu")
    codes, hidden, positions = _inputs(seed=5)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    ids = target.vocab.to_id(codes)
    assert torch.equal(loaded(ids, hidden, positions, causal), drafter(ids, hidden, positions, causal))
    assert load_janus_drafter(save_janus_drafter(drafter, tmp_path / "fp16"), target).fc.weight.dtype == torch.float32

    with pytest.raises(CheckpointError, match="needs its target"):
        load_janus_drafter(d)
    other = JanusTarget(JanusConfig(**{**TINY.to_dict(), "hidden_size": 32, "head_width": 32}))
    with pytest.raises(CheckpointError, match="does not match the target's"):
        load_janus_drafter(d, other)

    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((d / "config.json").read_text())
    state = {k: v for k, v in state.items() if k != "layers.0.mlp.up_proj.weight"} | {"norm.weight": torch.ones(64)}
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys: layers.0.mlp.up_proj.weight; unexpected keys: norm"):
        load_janus_drafter(bad, target)
    (bad / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match="num_hidden_layers 2"):
        load_janus_drafter(bad, target)


def test_config_for_target():
    cfg = JanusDrafterConfig.for_target(TINY)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.num_image_codes) == (64, 2, 64)
    assert JanusDrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(CheckpointError, match="does not match"):
        JanusDrafter(JanusDrafterConfig.for_target(TINY, rope_theta=500.0), JanusTarget(TINY))
