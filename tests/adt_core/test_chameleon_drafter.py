"""LANTERN Chameleon drafter (16-key strict loader, forward held against transformers'
ChameleonDecoderLayer) and LANTERN's neighbour table."""

import numpy as np
import pytest
import torch

from adt_core.families.chameleon.drafter import NUM_TENSORS, load_chameleon_drafter, load_neighbours
from adt_core.families.chameleon.model import load_chameleon
from adt_core.families.contract import Drafter
from adt_core.families.weights import CheckpointError
from adt_core.round.lantern import nearest_codes
from adt_core.round.verify import Relaxation, node_acceptance
from chameleon_fixtures import HEADS, additive_mask, hf_config, make_drafter, make_hf_chameleon, make_neighbours


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    make_hf_chameleon(d, seed=0)
    return d


def _hf_layer(drafter):
    """transformers' ChameleonDecoderLayer + rotary embedding holding the drafter's layer weights
    (qk-norm rows expanded to one per head, as transformers stores them)."""
    from transformers import ChameleonConfig
    from transformers.models.chameleon.modeling_chameleon import ChameleonDecoderLayer, ChameleonRotaryEmbedding

    cfg = ChameleonConfig(**hf_config(num_hidden_layers=1))
    layer = ChameleonDecoderLayer(cfg, 0).eval()
    state = {k.removeprefix("layers.0."): v for k, v in drafter.state_dict().items() if k.startswith("layers.0.")}
    for k in [k for k in state if "_norm." in k]:
        state[k] = state[k].repeat_interleave(HEADS // state[k].shape[0], dim=0)
    layer.load_state_dict(state, strict=True)
    return layer, ChameleonRotaryEmbedding(cfg)


@pytest.mark.parametrize("groups,fmt", [(HEADS, "safetensors"), (1, "bin")])
@torch.no_grad()
def test_drafter_loads_16_keys_and_matches_transformers_layer(tmp_path, target_dir, groups, fmt):
    target = load_chameleon(target_dir)
    d = make_drafter(tmp_path, target_dir, qk_groups=groups, fmt=fmt)
    drafter = load_chameleon_drafter(d, target)
    assert isinstance(drafter, Drafter) and len(drafter.state_dict()) == NUM_TENSORS
    assert drafter.layers[0].self_attn.q_norm.weight.shape == (groups, 16)
    assert torch.equal(drafter.embed_tokens.weight, target.model.embed_tokens.weight)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 9400, (2, 6), generator=g)
    hidden = torch.randn(2, 6, 64, generator=g)
    positions = torch.arange(3, 9)[None].expand(2, -1)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    feats = drafter(tokens, hidden, positions, causal)

    layer, rotary = _hf_layer(drafter)
    x = drafter.fc(torch.cat([drafter.embed_tokens(tokens), hidden], dim=-1))
    out = layer(x, attention_mask=additive_mask(causal), position_ids=positions,
                position_embeddings=rotary(x, positions))
    ref = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)

    cache = drafter.new_cache(2, 16)  # two cached steps == one pass
    a = drafter(tokens[:, :4], hidden[:, :4], positions[:, :4], cache.attn_mask(causal[0, 0, :4, :4]), cache)
    b = drafter(tokens[:, 4:], hidden[:, 4:], positions[:, 4:],
                cache.attn_mask(torch.ones(2, 2, dtype=torch.bool).tril()), cache)
    torch.testing.assert_close(torch.cat([a, b], dim=1), feats, atol=1e-5, rtol=1e-5)
    assert target.head(feats).shape == (2, 6, 8192)


def test_strict_16_key_check_names_keys(tmp_path, target_dir):
    d = make_drafter(tmp_path / "miss", target_dir, drop="layers.0.self_attn.k_norm.bias")
    with pytest.raises(CheckpointError, match="missing keys: layers.0.self_attn.k_norm.bias"):
        load_chameleon_drafter(d)
    d = make_drafter(tmp_path / "extra", target_dir, extra={"norm.weight": torch.ones(64)})
    with pytest.raises(CheckpointError, match="unexpected keys: norm.weight"):
        load_chameleon_drafter(d)
    d = make_drafter(tmp_path / "shape", target_dir, extra={"fc.weight": torch.zeros(64, 64)})
    with pytest.raises(CheckpointError, match=r"misshaped keys: fc.weight \(64, 64\) \(expected \(64, 128\)\)"):
        load_chameleon_drafter(d)
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text("{}")
        load_chameleon_drafter(tmp_path / "empty")


def test_drafter_must_match_the_target(tmp_path, target_dir):
    import json

    d = make_drafter(tmp_path, target_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 500.0, "rope_type": "default"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not match the target"):
        load_chameleon_drafter(d, load_chameleon(target_dir).config)


def test_neighbour_table_loads_like_lantern_saves(tmp_path):
    path = make_neighbours(tmp_path / "top_63_indices.npy", 64)
    assert np.load(path).dtype == np.uint16
    full = load_neighbours(path)
    assert full.shape == (64, 63) and full.dtype == torch.long
    assert torch.equal(load_neighbours(path, k=5, num_codes=64), full[:, :5])
    with pytest.raises(CheckpointError, match="64 rows, the codebook has 8192"):
        load_neighbours(path, num_codes=8192)
    with pytest.raises(CheckpointError, match="63 neighbours per code, 64 asked"):
        load_neighbours(path, k=64)
    bad = np.load(path)
    bad[3, 0] = 3
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(CheckpointError, match="lists itself"):
        load_neighbours(tmp_path / "bad.npy")


def test_neighbour_table_equals_the_projects_from_the_codebook(tmp_path):
    book = torch.randn(48, 8, generator=torch.Generator().manual_seed(3))
    d = torch.cdist(book, book)
    d.fill_diagonal_(float("inf"))
    np.save(tmp_path / "t.npy", d.topk(47, dim=1, largest=False).indices.numpy().astype(np.uint16))
    assert torch.equal(load_neighbours(tmp_path / "t.npy", k=10), nearest_codes(book, 10))


def test_relaxation_with_the_loaded_table_keeps_the_tv_bound(tmp_path):
    table = load_neighbours(make_neighbours(tmp_path / "t.npy", 40), k=12)
    g = torch.Generator().manual_seed(2)
    for trial in range(40):
        p = torch.rand(40, generator=g).pow(4).double()
        p /= p.sum()
        delta = [0.05, 0.2, 0.5][trial % 3]
        kids = torch.randperm(40, generator=g)[: 1 + trial % 5].tolist()
        accept, residual = node_acceptance(p, kids, Relaxation(table, delta=delta))
        out, reach = torch.zeros_like(p), 1.0
        for x, a in zip(kids, accept):
            out[x] += reach * a
            reach *= 1 - a
        out += reach * residual.double()
        assert 0.5 * float((out - p).abs().sum()) <= delta + 1e-9
