"""Chameleon target: parity with transformers' ChameleonForConditionalGeneration (model.model +
lm_head, image-code columns) on tiny random checkpoints saved by save_pretrained, and strict loading."""

import json

import pytest
import torch

from adt_core.families.chameleon.model import ChameleonConfig, ChameleonTarget, load_chameleon
from adt_core.families.contract import Target
from adt_core.families.weights import CheckpointError
from adt_core.kv_cache import KVCache
from chameleon_fixtures import VOCAB, additive_mask, make_hf_chameleon

CODES = slice(4, 8196)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("anole")
    return d, make_hf_chameleon(d, seed=0)


@pytest.fixture(scope="module")
def lumina_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lumina")
    return d, make_hf_chameleon(d, seed=1, qk_groups=1)


def _prefix(rows=2, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, n), generator=g)


def _tree():
    """7 nodes: parents [-1, 0, 0, 1, 1, 2, 3] (node 0 = the root token); ancestor mask and depths."""
    parents = [-1, 0, 0, 1, 1, 2, 3]
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            depth[i] += 1
            p = parents[p]
    return mask, torch.tensor(depth)


@torch.no_grad()
def _hf_logits(model, ids, positions=None, mask=None, cache=None):
    out = model.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
    return model.lm_head(out.last_hidden_state)[..., CODES], out.last_hidden_state, out.cache


@pytest.mark.parametrize("which", ["hf_dir", "lumina_dir"])
@torch.no_grad()
def test_flat_prefix_and_tree_step_match_transformers(which, request):
    d, hf = request.getfixturevalue(which)
    model = load_chameleon(d)
    assert isinstance(model, Target)
    groups = 1 if which == "lumina_dir" else 4
    assert model.config.qk_norm_groups == groups
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (groups, 16)

    ids = _prefix()
    rows, n = ids.shape
    ref, ref_hidden, hf_cache = _hf_logits(hf, ids)
    cache = model.new_cache(rows, 64)
    causal = cache.attn_mask(torch.ones(n, n, dtype=torch.bool).tril())
    logits, hidden = model(torch.arange(n), causal, cache, tokens=ids)
    assert logits.shape == (rows, n, 8192) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)

    tree_mask, depth = _tree()
    tree_ids = _prefix(rows, tree_mask.shape[0], seed=3)
    positions = (n + depth)[None].expand(rows, -1)
    mask = cache.attn_mask(tree_mask)  # (R, 1, S, n + S) bool
    ref, _, _ = _hf_logits(hf, tree_ids, positions, additive_mask(mask), hf_cache)
    logits, _ = model(positions, mask, cache, tokens=tree_ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_tree_step_equals_sequential_path(hf_dir):
    """A tree node's logits equal a plain causal forward over its root-to-node path."""
    d, _ = hf_dir
    model = load_chameleon(d)
    ids = _prefix(1, 5)
    tree_mask, depth = _tree()
    tree_ids = _prefix(1, 7, seed=4)
    cache = model.new_cache(1, 32)
    model(torch.arange(5), cache.attn_mask(torch.ones(5, 5, dtype=torch.bool).tril()), cache, tokens=ids)
    logits, _ = model(5 + depth, cache.attn_mask(tree_mask), cache, tokens=tree_ids)
    path = [0, 1, 3, 6]  # node 6's ancestors
    seq = torch.cat([ids, tree_ids[:, path]], dim=1)
    flat, _ = model(torch.arange(9), torch.ones(9, 9, dtype=torch.bool).tril()[None, None], None, tokens=seq)
    torch.testing.assert_close(logits[0, 6], flat[0, -1], atol=1e-5, rtol=1e-5)


def test_single_file_checkpoint_and_dtype(tmp_path):
    make_hf_chameleon(tmp_path, seed=2, shard_size="50MB")
    assert (tmp_path / "model.safetensors").is_file()
    model = load_chameleon(tmp_path, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.shape == (8192, 64)
    assert model.new_cache(2, 8).k.dtype == torch.bfloat16


def _shard_holding(d, key):
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][key]


def test_missing_shard_names_it(tmp_path):
    make_hf_chameleon(tmp_path, seed=0)
    shard = _shard_holding(tmp_path, "model.layers.1.mlp.up_proj.weight")
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard {shard}"):
        load_chameleon(tmp_path)


def test_misshapen_and_missing_tensors_name_themselves(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_chameleon(tmp_path, seed=0)
    key = "model.layers.0.self_attn.k_proj.weight"
    shard = tmp_path / _shard_holding(tmp_path, key)
    state = load_file(str(shard))
    state[key] = state[key][:, :32].contiguous()
    save_file(state, str(shard))
    with pytest.raises(CheckpointError, match=r"misshaped keys: model.layers.0.self_attn.k_proj.weight \(64, 32\)"):
        load_chameleon(tmp_path)

    index = tmp_path / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    del meta["weight_map"]["model.norm.weight"]
    index.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="missing keys: model.norm.weight"):
        load_chameleon(tmp_path)


def test_config_parsing():
    old = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "num_hidden_layers": 2,
           "vocab_size": VOCAB, "rope_theta": 500.0, "swin_norm": True}
    cfg = ChameleonConfig.from_hf(old, qk_norm_groups=1)
    assert (cfg.rope_theta, cfg.swin_norm, cfg.qk_norm_groups, cfg.k_norm_groups) == (500.0, True, 1, 1)
    with pytest.raises(CheckpointError, match="attention_bias"):
        ChameleonConfig.from_hf({**old, "attention_bias": True})
    with pytest.raises(CheckpointError, match="missing field 'vocab_size'"):
        ChameleonConfig.from_hf({k: v for k, v in old.items() if k != "vocab_size"})
    with pytest.raises(CheckpointError, match="qk-norm groups 3"):
        ChameleonConfig.from_hf(old, qk_norm_groups=3)


def test_7b_shapes_without_weights():
    cfg = ChameleonConfig.chameleon_7b()
    with torch.device("meta"):
        m = ChameleonTarget(cfg)
    assert sum(p.numel() for p in m.parameters()) == cfg.num_params()
    assert 6.7e9 < cfg.num_params() < 6.9e9  # 7.0B with the full 65536-row lm_head
    assert cfg.kv_width == 4096 and cfg.vocab.id_slice == CODES


@torch.no_grad()
def test_swin_norm_matches_transformers(tmp_path):
    hf = make_hf_chameleon(tmp_path, seed=5, swin_norm=True)
    model = load_chameleon(tmp_path)
    ids = _prefix(1, 6)
    ref, _, _ = _hf_logits(hf, ids)
    logits, _ = model(torch.arange(6), torch.ones(6, 6, dtype=torch.bool).tril()[None, None], tokens=ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_kv_cache_type(hf_dir):
    model = load_chameleon(hf_dir[0])
    assert isinstance(model.new_cache(3, 10), KVCache)
