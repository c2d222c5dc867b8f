"""Chameleon VQGAN: Meta's file layout loads strictly; shapes; encoder/quantizer parity with
transformers' ChameleonVQVAE (encoder-only there); codebook round trip."""

import pytest
import torch
import yaml

from adt_core.families.chameleon.vq import ChameleonVQ, VQGANConfig, load_chameleon_vq, to_uint8
from adt_core.families.contract import Decoder
from adt_core.families.weights import CheckpointError
from chameleon_fixtures import make_vqgan, vqgan_yaml


@pytest.fixture(scope="module")
def vq_dir(tmp_path_factory):
    return make_vqgan(tmp_path_factory.mktemp("vq"), seed=0)


def test_meta_layout_loads_and_decodes_shapes(vq_dir):
    vq = load_chameleon_vq(vq_dir)
    assert isinstance(vq, Decoder) and vq.downsample_factor == 2
    assert "decoder.up.0.block.1.conv2.weight" in vq.state_dict()  # 1 + 1 blocks per level
    assert "decoder.up.1.upsample.conv.weight" in vq.state_dict() and not hasattr(vq.decoder.up[0], "upsample")
    assert "decoder.mid.attn_1.q.weight" in vq.state_dict()
    codes = torch.randint(0, 32, (2, 3, 5))
    img = vq.decode(codes)
    assert img.shape == (2, 6, 10, 3) and img.dtype == torch.uint8
    assert vq.encode(img).shape == (2, 3, 5)


def test_codebook_round_trip(vq_dir):
    vq = load_chameleon_vq(vq_dir)
    codes = torch.randint(0, 32, (2, 4, 4))
    assert torch.equal(vq.quantize.nearest(vq.quantize.lookup(codes)), codes)


def test_encoder_and_quantizer_match_transformers(vq_dir):
    from transformers import ChameleonVQVAE, ChameleonVQVAEConfig

    vq = load_chameleon_vq(vq_dir)
    c = vq.cfg
    hf = ChameleonVQVAE(ChameleonVQVAEConfig(
        embed_dim=c.embed_dim, num_embeddings=c.n_embed, latent_channels=c.z_channels, resolution=c.resolution,
        base_channels=c.ch, channel_multiplier=list(c.ch_mult), num_res_blocks=c.num_res_blocks,
        attn_resolutions=list(c.attn_resolutions), attn_type=c.attn_type)).eval()
    state = {k: v for k, v in vq.state_dict().items() if not k.startswith("decoder.")}
    hf.load_state_dict(state, strict=True)
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ref = hf.encode(x, return_dict=True).image_tokens.view(2, 4, 4)
    assert torch.equal(vq.encode(x), ref)


def test_strict_loading_names_keys(tmp_path):
    make_vqgan(tmp_path / "ok", extra={"loss.discriminator.main.0.weight": torch.zeros(2)})
    load_chameleon_vq(tmp_path / "ok" / "vqgan.ckpt")  # training-only loss.* entries are skipped

    make_vqgan(tmp_path / "miss", drop="decoder.conv_out.bias")
    with pytest.raises(CheckpointError, match="missing keys: decoder.conv_out.bias"):
        load_chameleon_vq(tmp_path / "miss")

    make_vqgan(tmp_path / "extra", extra={"quantize.used": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="unexpected keys: quantize.used"):
        load_chameleon_vq(tmp_path / "extra")

    d = make_vqgan(tmp_path / "noattn")
    (d / "vqgan.yaml").write_text(yaml.safe_dump(vqgan_yaml(attn_type="none")))
    with pytest.raises(CheckpointError, match="unexpected keys: decoder.mid.attn_1"):
        load_chameleon_vq(d)

    with pytest.raises(CheckpointError, match="needs vqgan.yaml"):
        load_chameleon_vq(tmp_path / "nothing_here")


def test_attn_type_none_and_tokenizer_subfolder(tmp_path):
    make_vqgan(tmp_path / "tokenizer", attn_type="none")
    vq = load_chameleon_vq(tmp_path)  # DIR/tokenizer/vqgan.{yaml,ckpt}, Meta's checkpoint layout
    assert isinstance(vq.decoder.mid.attn_1, torch.nn.Identity)


def test_safetensors_weights(tmp_path, vq_dir):
    from safetensors.torch import save_file

    src = load_chameleon_vq(vq_dir)
    (tmp_path / "vqgan.yaml").write_text((vq_dir / "vqgan.yaml").read_text())
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "vqgan.safetensors"))
    vq = load_chameleon_vq(tmp_path)
    codes = torch.randint(0, 32, (1, 2, 2))
    assert torch.equal(vq.decode(codes), src.decode(codes))


def test_meta_7b_vqgan_shapes_without_weights():
    cfg = VQGANConfig()
    with torch.device("meta"):
        vq = ChameleonVQ(cfg)
        z = vq.decoder(torch.empty(1, 256, 48, 48))
    assert cfg.downsample_factor == 16 and z.shape == (1, 3, 768, 768)
    assert vq.quantize.embedding.weight.shape == (8192, 256)
    assert not any(len(level.attn) for level in vq.decoder.up)  # attention in the mid block only


def test_uint8_conversion_truncates_like_meta():
    x = torch.tensor([-2.0, -1.0, 0.0, 0.999, 1.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5)
    assert to_uint8(x)[0, 0, :, 0].tolist() == [0, 0, 127, 254, 255]
