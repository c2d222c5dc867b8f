import pytest
import torch
import torch.nn.functional as F

from adt_core.families.vqgan import VQConfig, VQModel, count_parameters, to_uint8

TINY = VQConfig(codebook_size=64, codebook_embed_dim=4, z_channels=32, ch=32,
                ch_mult=(1, 2), num_res_blocks=1)


def tiny_model(seed: int = 0, cfg: VQConfig = TINY) -> VQModel:
    torch.manual_seed(seed)
    return VQModel(cfg).eval()


def test_vq16_parameter_count_on_meta_device():
    with torch.device("meta"):
        model = VQModel(VQConfig.vq16())
    assert count_parameters(model) == 71_883_403
    assert model.quantize.codebook_used.numel() == 65536
    assert model.downsample_factor == 16


@pytest.mark.parametrize("h,w", [(16, 16), (8, 24)])
def test_encode_decode_shapes_uint8_input(h, w):
    model = tiny_model()
    f = model.downsample_factor
    images = torch.randint(0, 256, (2, h, w, 3), dtype=torch.uint8)
    codes = model.encode(images)
    assert codes.shape == (2, h // f, w // f) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < TINY.codebook_size
    out = model.decode(codes)
    assert out.shape == (2, h, w, 3) and out.dtype == torch.uint8
    assert model.decode_float(codes).shape == (2, 3, h, w)


def test_float_and_uint8_inputs_agree():
    model = tiny_model()
    images = torch.randint(0, 256, (1, 8, 8, 3), dtype=torch.uint8)
    as_float = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    assert torch.equal(model.encode(images), model.encode(as_float))


def test_codebook_lookup_is_cosine_nearest():
    model = tiny_model()
    q = model.quantize
    with torch.no_grad():  # make the raw code norms very uneven: L2 lookup must ignore them
        q.embedding.weight.mul_(torch.linspace(0.1, 10.0, TINY.codebook_size)[:, None])
    z = torch.randn(2, TINY.codebook_embed_dim, 3, 5) * 7.0  # (B, e, h, w)
    codes, _ = q.nearest(z)
    flat = z.permute(0, 2, 3, 1).reshape(-1, TINY.codebook_embed_dim)
    cos = F.normalize(flat, dim=-1) @ F.normalize(q.embedding.weight, dim=-1).t()
    assert torch.equal(codes.reshape(-1), cos.argmax(-1))
    vectors = q.lookup(codes)  # (B, e, h, w): unit length
    assert torch.allclose(vectors.norm(dim=1), torch.ones(2, 3, 5), atol=1e-5)


def test_training_forward_returns_losses_and_records_usage():
    model = tiny_model().train()
    x = torch.rand(2, 3, 8, 12) * 2 - 1
    recon, losses = model(x)
    assert recon.shape == x.shape
    assert set(losses) >= {"codebook", "commit", "usage"}
    (F.mse_loss(recon, x) + losses["codebook"] + losses["commit"]).backward()
    assert model.encoder.conv_in.weight.grad is not None  # straight-through reaches encoder
    assert model.quantize.embedding.weight.grad is not None
    assert 0 < losses["usage"] <= 1


def test_to_uint8_rounding():
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5)
    assert to_uint8(x)[0, 0, :, 0].tolist() == [0, 0, 128, 255, 255]


LLAMAGEN_KEYS = [
    "encoder.conv_in.weight",
    "encoder.conv_blocks.0.res.0.norm1.weight",
    "encoder.conv_blocks.0.res.0.conv1.weight",
    "encoder.conv_blocks.0.res.0.norm2.bias",
    "encoder.conv_blocks.0.res.1.conv2.weight",
    "encoder.conv_blocks.0.downsample.conv.weight",
    "encoder.conv_blocks.1.res.0.nin_shortcut.weight",
    "encoder.conv_blocks.2.attn.1.norm.weight",
    "encoder.conv_blocks.2.attn.0.q.weight",
    "encoder.conv_blocks.2.attn.0.k.bias",
    "encoder.conv_blocks.2.attn.0.v.weight",
    "encoder.conv_blocks.2.attn.0.proj_out.weight",
    "encoder.mid.0.conv1.weight",
    "encoder.mid.1.q.weight",
    "encoder.mid.2.norm2.weight",
    "encoder.norm_out.weight",
    "encoder.conv_out.weight",
    "quant_conv.weight",
    "quantize.embedding.weight",
    "quantize.codebook_used",
    "post_quant_conv.bias",
    "decoder.conv_in.weight",
    "decoder.mid.1.proj_out.weight",
    "decoder.conv_blocks.0.res.2.conv2.weight",
    "decoder.conv_blocks.0.attn.2.q.weight",
    "decoder.conv_blocks.0.upsample.conv.weight",
    "decoder.conv_blocks.2.res.0.nin_shortcut.weight",
    "decoder.conv_blocks.2.res.2.conv1.weight",
    "decoder.norm_out.bias",
    "decoder.conv_out.weight",
]


def test_state_dict_has_llamagen_names():
    cfg = VQConfig(codebook_size=32, codebook_embed_dim=4, z_channels=32, ch=32,
                   ch_mult=(1, 2, 2), num_res_blocks=2)
    keys = set(tiny_model(cfg=cfg).state_dict())
    missing = [k for k in LLAMAGEN_KEYS if k not in keys]
    assert not missing
    # attention only at the lowest resolution; no upsample on the last decoder level
    assert not any(k.startswith(("encoder.conv_blocks.0.attn", "encoder.conv_blocks.1.attn",
                                 "decoder.conv_blocks.1.attn")) for k in keys)
    assert not any(k.startswith(("encoder.conv_blocks.2.downsample",
                                 "decoder.conv_blocks.2.upsample")) for k in keys)
    # and the state dict loads strictly into a fresh model
    VQModel(cfg).load_state_dict(tiny_model(seed=1, cfg=cfg).state_dict(), strict=True)


def test_config_round_trip():
    d = VQConfig.vq16().to_dict()
    assert VQConfig.from_dict(d) == VQConfig.vq16()
    assert VQConfig.vq16().downsample_factor == 16
    with pytest.raises(ValueError):
        VQConfig(ch=48)


def test_save_and_load_pretrained_round_trip(tmp_path):
    from adt_core.families.vqgan import from_pretrained, save_pretrained

    model = tiny_model(seed=3)
    save_pretrained(model, tmp_path, dtype=torch.float32)
    loaded = from_pretrained(tmp_path)
    assert loaded.cfg == model.cfg
    images = torch.randint(0, 256, (1, 8, 8, 3), dtype=torch.uint8)
    assert torch.equal(loaded.encode(images), model.encode(images))
