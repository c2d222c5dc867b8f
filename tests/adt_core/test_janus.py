"""Janus target: parity with transformers' JanusForConditionalGeneration image-generation path
(prepare_embeddings_for_image_generation -> language model -> generation_head) on tiny random
checkpoints in both on-disk layouts, CFG greedy decoding equal to its generate(generation_mode=
"image"), and strict loading."""

import json

import pytest
import torch

from adt_core.families.contract import Target
from adt_core.families.registry import get_family
from adt_core.families.janus.model import JanusConfig, JanusTarget
from adt_core.families.janus.weights import expected_shapes, load_janus, to_hf_name
from adt_core.families.weights import CheckpointError
from adt_core.kv_cache import KVCache
from janus_fixtures import (
    BOI,
    BOS,
    CODES,
    GRID,
    PAD,
    TEXT_VOCAB,
    additive_mask,
    make_hf_janus,
    published_name,
    save_published,
    save_transformers,
)

pytest.importorskip("transformers.models.janus", reason="transformers >= 4.52 has models/janus")


@pytest.fixture(scope="module")
def hf():
    return make_hf_janus(seed=0)


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory, hf):
    return save_published(hf, tmp_path_factory.mktemp("janus_pub"))


@pytest.fixture(scope="module")
def transformers_dir(tmp_path_factory, hf):
    return save_transformers(hf, tmp_path_factory.mktemp("janus_hf"))


def _ids(rows, n, seed=0, high=TEXT_VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (rows, n), generator=g)


def _tree():
    """7 nodes: parents [-1, 0, 0, 1, 1, 2, 3]; ancestor mask and depths."""
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
def _hf_step(hf, positions=None, mask=None, cache=None, ids=None, codes=None):
    """transformers' image-generation path: text ids through the LM's embedding, codes through
    prepare_embeddings_for_image_generation; logits from generation_head."""
    embeds = hf.get_input_embeddings()(ids) if ids is not None else hf.prepare_embeddings_for_image_generation(codes)
    out = hf.model.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, cache=cache,
                                  use_cache=True)
    h = out.last_hidden_state
    return hf.model.generation_head(h), h, out.cache


@pytest.mark.parametrize("which", ["published_dir", "transformers_dir"])
@torch.no_grad()
def test_flat_prefix_and_tree_step_match_transformers(which, hf, request):
    model = load_janus(request.getfixturevalue(which))
    assert isinstance(model, Target)
    first = model.vocab.first_id
    assert (first, model.vocab.num_codes, model.vocab.vocab_size) == (TEXT_VOCAB, CODES, TEXT_VOCAB + CODES)

    ids = _ids(2, 9)
    rows, n = ids.shape
    ref, ref_hidden, hf_cache = _hf_step(hf, ids=ids)
    cache = model.new_cache(rows, 64)
    logits, hidden = model(torch.arange(n), cache.attn_mask(torch.ones(n, n, dtype=torch.bool).tril()), cache,
                           tokens=ids)
    assert logits.shape == (rows, n, CODES) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)

    tree_mask, depth = _tree()  # a tree of image codes after the prefix
    codes = _ids(rows, tree_mask.shape[0], seed=3, high=CODES)
    positions = (n + depth)[None].expand(rows, -1)
    mask = cache.attn_mask(tree_mask)  # (R, 1, S, n + S) bool
    ref, _, _ = _hf_step(hf, positions, additive_mask(mask), hf_cache, codes=codes)
    logits, _ = model(positions, mask, cache, tokens=codes + first)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_mixed_ids_and_embeds_inputs(published_dir, hf):
    """Text and code ids in one row embed through their own paths; embeds= gives the same."""
    model = load_janus(published_dir)
    text, codes = _ids(1, 4), _ids(1, 3, seed=1, high=CODES)
    tokens = torch.cat([text, codes + TEXT_VOCAB], dim=1)
    embeds = torch.cat([hf.get_input_embeddings()(text), hf.prepare_embeddings_for_image_generation(codes)], dim=1)
    torch.testing.assert_close(model.embed(tokens), embeds, atol=1e-6, rtol=1e-6)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    a, _ = model(torch.arange(7), causal, tokens=tokens)
    b, _ = model(torch.arange(7), causal, embeds=embeds)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    with pytest.raises(IndexError):
        model.embed(torch.tensor([[TEXT_VOCAB + CODES]]))


@torch.no_grad()
def test_tree_step_equals_sequential_path(published_dir):
    model = load_janus(published_dir)
    ids = _ids(1, 5)
    tree_mask, depth = _tree()
    codes = _ids(1, 7, seed=4, high=CODES) + TEXT_VOCAB
    cache = model.new_cache(1, 32)
    model(torch.arange(5), cache.attn_mask(torch.ones(5, 5, dtype=torch.bool).tril()), cache, tokens=ids)
    logits, _ = model(5 + depth, cache.attn_mask(tree_mask), cache, tokens=codes)
    path = [0, 1, 3, 6]  # node 6's ancestors
    seq = torch.cat([ids, codes[:, path]], dim=1)
    flat, _ = model(torch.arange(9), torch.ones(9, 9, dtype=torch.bool).tril()[None, None], None, tokens=seq)
    torch.testing.assert_close(logits[0, 6], flat[0, -1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_cfg_greedy_equals_transformers_generate(published_dir, hf):
    """Janus' CFG rows (uncond: BOS, pads, begin-of-image; pads attended) and the code -> id
    feed, decoded greedily at CFG 5 with this target, give transformers' generate() tokens."""
    from transformers import GenerationConfig

    model = load_janus(published_dir)
    text = _ids(2, 6, seed=7, high=256)  # two prompts of equal length (no padding in HF's batch)
    cond = torch.cat([torch.full((2, 1), BOS), text, torch.full((2, 1), BOI)], dim=1)
    gen = GenerationConfig(do_sample=False, guidance_scale=5.0, bos_token_id=BOS, pad_token_id=PAD,
                           generation_kwargs={"boi_token_id": BOI}, max_new_tokens=GRID * GRID)
    ref = hf.generate(cond, attention_mask=torch.ones_like(cond), generation_mode="image", generation_config=gen)
    assert ref.shape == (2, GRID * GRID)

    uncond = cond.clone()
    uncond[:, 1:-1] = PAD
    rows = torch.cat([cond, uncond])
    n = rows.shape[1]
    cache = model.new_cache(4, n + GRID * GRID)
    logits, _ = model(torch.arange(n), cache.attn_mask(torch.ones(n, n, dtype=torch.bool).tril()), cache, tokens=rows)
    out = []
    for i in range(GRID * GRID):
        last = logits[:, -1]
        mixed = last[2:] + 5.0 * (last[:2] - last[2:])
        code = mixed.argmax(-1)
        out.append(code)
        ids = model.vocab.to_id(code).repeat(2)[:, None]
        logits, _ = model(torch.full((4, 1), n + i), cache.attn_mask(torch.ones(1, 1, dtype=torch.bool)), cache,
                          tokens=ids)
    assert torch.equal(torch.stack(out, 1), ref)


def test_published_names_and_transformers_names():
    cfg = JanusConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=TEXT_VOCAB, num_image_codes=CODES, head_width=64)
    names = set(expected_shapes(cfg))
    assert {"gen_embed.weight", "gen_aligner.layers.0.weight", "gen_aligner.layers.2.bias",
            "gen_head.output_mlp_projector.weight", "gen_head.vision_head.bias",
            "language_model.model.layers.1.self_attn.q_proj.weight", "language_model.model.norm.weight"} <= names
    assert not any("lm_head" in k or k.startswith(("vision_model", "aligner", "gen_vision_model")) for k in names)
    for k in names:  # the reverse map agrees with the fixture's published <- transformers map
        assert published_name(to_hf_name(k)) == k


def test_single_bin_and_safetensors_shards_and_dtype(tmp_path, hf):
    a = load_janus(save_published(hf, tmp_path / "one", shards=1))
    b = load_janus(save_published(hf, tmp_path / "st", shards=3, fmt="safetensors"), dtype=torch.bfloat16)
    assert (tmp_path / "one" / "pytorch_model.bin").is_file()
    assert b.gen_head.vision_head.weight.dtype == torch.bfloat16 and b.new_cache(2, 8).k.dtype == torch.bfloat16
    torch.testing.assert_close(b.gen_embed.weight.float(), a.gen_embed.weight, atol=1e-2, rtol=1e-2)


def test_missing_shard_names_it(tmp_path, hf):
    d = save_published(hf, tmp_path)
    weight_map = json.loads((d / "pytorch_model.bin.index.json").read_text())["weight_map"]
    shard = weight_map["gen_head.vision_head.weight"]
    (d / shard).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard {shard}"):
        load_janus(d)


def test_misshapen_missing_and_unknown_tensors_name_themselves(tmp_path, hf):
    d = save_published(hf, tmp_path / "shape", extra={"gen_aligner.layers.2.weight": torch.zeros(64, 32)})
    with pytest.raises(CheckpointError, match=r"misshaped keys: gen_aligner.layers.2.weight \(64, 32\) "
                                              r"\(expected \(64, 64\)\)"):
        load_janus(d)
    d = save_published(hf, tmp_path / "miss", drop="language_model.model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match="missing keys: language_model.model.layers.1.mlp.up_proj.weight"):
        load_janus(d)
    d = save_published(hf, tmp_path / "extra", extra={"gen_head.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected keys: gen_head.extra.weight"):
        load_janus(d)


def test_transformers_layout_errors_use_its_names(tmp_path, hf):
    from safetensors.torch import load_file, save_file

    d = save_transformers(hf, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.generation_head.proj_out.weight"
    shard = d / index[key]
    state = load_file(str(shard))
    state[key] = state[key][:, :32].contiguous()
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"misshaped keys: model.generation_head.proj_out.weight \(64, 32\)"):
        load_janus(d)


def test_config_parsing(tmp_path, hf):
    from janus_fixtures import published_config

    pub = published_config(hf)
    cfg = JanusConfig.from_json(pub)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.code_dim, cfg.aligner_depth) == (1e-6, 10000.0, 8, 2)
    bad = json.loads(json.dumps(pub))
    bad["gen_aligner_config"]["params"]["n_embed"] = 32
    with pytest.raises(CheckpointError, match="gen_aligner n_embed 32 != the language model's hidden size 64"):
        JanusConfig.from_json(bad)
    bad = json.loads(json.dumps(pub))
    bad["language_config"]["rope_scaling"] = {"type": "linear", "factor": 2.0}
    with pytest.raises(CheckpointError, match="RoPE type 'linear'"):
        JanusConfig.from_json(bad)
    bad = json.loads(json.dumps(pub))
    del bad["language_config"]["vocab_size"]
    with pytest.raises(CheckpointError, match="missing field 'vocab_size'"):
        JanusConfig.from_json(bad)
    with pytest.raises(CheckpointError, match="not a Janus config"):
        JanusConfig.from_json({"model_type": "llama"})
    hf_cfg = JanusConfig.from_json(hf.config.to_dict())
    assert hf_cfg == cfg
    (tmp_path / "config.json").write_text(json.dumps(pub))
    with pytest.raises(CheckpointError, match="none of model.safetensors.index.json"):
        load_janus(tmp_path)


@torch.no_grad()
def test_gqa_matches_transformers(tmp_path):
    hf = make_hf_janus(seed=5, kv_heads=2)
    model = load_janus(save_published(hf, tmp_path))
    assert model.config.num_key_value_heads == 2 and model.new_cache(1, 4).k.shape[2] == 2
    ids = _ids(1, 6)
    ref, _, _ = _hf_step(hf, ids=ids)
    logits, _ = model(torch.arange(6), torch.ones(6, 6, dtype=torch.bool).tril()[None, None], tokens=ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_7b_shapes_without_weights():
    cfg = JanusConfig.janus_pro_7b()
    with torch.device("meta"):
        m = JanusTarget(cfg)
    assert sum(p.numel() for p in m.parameters()) == cfg.num_params()
    assert 6.55e9 < cfg.num_params() < 6.65e9  # 30 layers + embedding + image in/out; no text head, no SigLIP
    assert cfg.vocab.first_id == 102400 and cfg.vocab.num_codes == 16384
    assert m.gen_head.vision_head.weight.shape == (16384, 4096) and m.gen_embed.weight.shape == (16384, 8)


def test_family_registered(published_dir):
    fam = get_family("janus")
    assert fam.name == "janus"
    model = fam.load_target(published_dir, dtype=torch.float32, device="cpu")
    assert isinstance(model, JanusTarget) and isinstance(model.new_cache(1, 4), KVCache)
