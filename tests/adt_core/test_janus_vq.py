"""Janus' VQ-16 decoder: the LlamaGen VQ (adt_core.families.vqgan) loads its weights after a key remap,
from a checkpoint in deepseek-ai/Janus' layout (gen_vision_model.*) or transformers' (model.vqmodel.*),
and decodes like transformers' JanusVQVAE.decode; Janus' pixel conversion; strict loading."""

import pytest
import torch

from adt_core.families.contract import Decoder
from adt_core.families.janus.model import JanusVQ
from adt_core.families.janus.weights import PUBLISHED, load_janus_vq, remap_vq_state
from adt_core.families.llamagen.weights import infer_vq_config
from adt_core.families.vqgan import VQConfig, VQModel
from adt_core.families.weights import CheckpointError
from janus_fixtures import CODES, GRID, make_hf_janus, save_published, save_transformers

pytest.importorskip("transformers.models.janus", reason="transformers >= 4.52 has models/janus")


@pytest.fixture(scope="module")
def hf():
    return make_hf_janus(seed=1)


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory, hf):
    return save_published(hf, tmp_path_factory.mktemp("janus_vq_pub"))


def _codes(b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODES, (b, GRID, GRID), generator=g)


@torch.no_grad()
def test_published_vq_loads_into_llamagen_vq_and_decodes_like_transformers(published_dir, hf, tmp_path):
    vq = load_janus_vq(published_dir)
    assert isinstance(vq, JanusVQ) and isinstance(vq, VQModel) and isinstance(vq, Decoder)
    assert vq.cfg == VQConfig(codebook_size=CODES, codebook_embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 2),
                              num_res_blocks=1)
    assert vq.downsample_factor == 2
    codes = _codes()
    ref = hf.model.vqmodel.decode(codes.flatten(1))  # (B, 3, 8, 8) in [-1, 1]-ish
    got = vq.decode_float(codes)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

    img = vq.decode(codes)  # Janus: uint8 = trunc(clip((x + 1) / 2 * 255, 0, 255))
    assert img.shape == (2, 2 * GRID, 2 * GRID, 3) and img.dtype == torch.uint8
    expect = ((ref.permute(0, 2, 3, 1) + 1) / 2 * 255).clamp(0, 255).to(torch.uint8)
    assert torch.equal(img, expect)

    other = load_janus_vq(save_transformers(hf, tmp_path / "hf"))  # transformers' layout: same weights
    assert torch.equal(other.decode_float(codes), got)


def test_real_vq16_names_remap_to_llamagen_vq16():
    """Every tensor of a full-size VQ-16 under gen_vision_model.* (Janus' vq_model.py is
    LlamaGen's module tree) maps onto VQModel(VQConfig.vq16()) and its shapes say VQ-16."""
    with torch.device("meta"):
        ref = VQModel(VQConfig.vq16()).state_dict()
    state = remap_vq_state({"gen_vision_model." + k: v for k, v in ref.items()} | {"gen_embed.weight": None},
                           PUBLISHED)
    assert set(state) == set(ref)
    assert infer_vq_config(state) == VQConfig.vq16()


def test_strict_vq_errors_name_keys(tmp_path, hf):
    d = save_published(hf, tmp_path / "miss", drop="gen_vision_model.decoder.conv_out.weight")
    with pytest.raises(CheckpointError, match="missing keys: decoder.conv_out.weight"):
        load_janus_vq(d)
    bad = {"gen_vision_model.post_quant_conv.weight": torch.zeros(32, 4, 1, 1)}
    d = save_published(hf, tmp_path / "shape", extra=bad)
    with pytest.raises(CheckpointError, match=r"misshaped keys: post_quant_conv.weight \(32, 4, 1, 1\)"):
        load_janus_vq(d)
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("model.vqmodel.")}
    (tmp_path / "novq").mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(tmp_path / "novq" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no model.vqmodel.\* tensors"):
        load_janus_vq(tmp_path / "novq")


def test_codebook_used_optional_and_dtype(tmp_path, hf):
    d = save_published(hf, tmp_path, drop="gen_vision_model.quantize.codebook_used")
    vq = load_janus_vq(d, dtype=torch.bfloat16)
    assert vq.quant_conv.weight.dtype == torch.bfloat16
    assert vq.decode(_codes(1)).shape == (1, 8, 8, 3)
