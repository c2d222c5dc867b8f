"""Loaders for the published layouts: LlamaGen GPT (original .pt and HF-converted), LlamaGen VQ,
LANTERN drafters. Every checkpoint here is tiny and random, written by the helpers below in the
exact key layout of the published files. Parameter counts of the real XL target, drafter and
VQ-16 on the meta device are asserted in test_models.py / test_vq.py; here the loaders'
config inference is checked against those real configs."""

from __future__ import annotations

import dataclasses
import argparse
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adt_core.families.llamagen.drafter_weights import drafter_config_from_lantern, load_lantern_drafter
from adt_core.families.weights import CheckpointError, unwrap_state_dict
from adt_core.families.llamagen.weights import (
    hf_gpt_names, infer_gpt_config, infer_vq_config, load_llamagen_gpt, load_vq,
)
from adt_core.families.llamagen.drafter import Drafter, DrafterConfig
from adt_core.families.llamagen.model import GPTConfig, LlamaGenGPT
from adt_core.families.vqgan import VQConfig, VQModel

# A tiny LlamaGen: not a published size, so heads come from args / n_head. multiple_of=64 is
# what the loader infers back from the FFN width (8 * 64 / 3 -> 192).
TINY_GPT = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=32, cls_token_num=8, caption_dim=16,
                     grid_h=4, grid_w=4, multiple_of=64)
TINY_VQ = VQConfig(codebook_size=32, codebook_embed_dim=4, z_channels=32, ch=32, ch_mult=(1, 1), num_res_blocks=1)


# ---- writers of the published layouts (test fixtures, written from the format facts) ---------
def tiny_gpt(cfg: GPTConfig = TINY_GPT, seed: int = 0) -> LlamaGenGPT:
    torch.manual_seed(seed)
    m = LlamaGenGPT(cfg).eval()
    with torch.no_grad():
        m.output.weight.mul_(8.0)  # peaked logits, as a trained model's (no near-ties)
    return m


def llamagen_args(cfg: GPTConfig, gpt_model: str = "GPT-tiny") -> argparse.Namespace:
    """The "args" LlamaGen's train_t2i.py stores in its checkpoints."""
    return argparse.Namespace(gpt_model=gpt_model, gpt_type="t2i", image_size=cfg.grid_h * 16, downsample_size=16,
                              cls_token_num=cfg.cls_token_num, vocab_size=cfg.vocab_size, lr=1e-4,
                              mixed_precision="bf16", results_dir="results", no_compile=False)


def write_llamagen_pt(model: LlamaGenGPT, path: Path, wrapper: str = "model", prefix: str = "",
                      args: argparse.Namespace | None = None, extras: bool = True) -> Path:
    """LlamaGen training checkpoint: {wrapper: state_dict, "optimizer", "steps", "args"}."""
    state = {prefix + k: v.clone() for k, v in model.state_dict().items()}
    if extras:  # what real files may carry besides weights: RoPE table, inference KV caches
        state[prefix + "freqs_cis"] = torch.randn(4, 2)
        state[prefix + "layers.0.attention.kv_cache.k_cache"] = torch.zeros(1, 2, 3, 4)
        state[prefix + "layers.0.attention.kv_cache.v_cache"] = torch.zeros(1, 2, 3, 4)
    ckpt = {wrapper: state, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-4}]},
            "steps": 5000, "args": args if args is not None else llamagen_args(model.config)}
    torch.save(ckpt, path)
    return path


def hf_state(model: LlamaGenGPT) -> dict[str, torch.Tensor]:
    """The HF-converted keys (LANTERN's LlamaGen-T2I): q/k/v = row thirds of wqkv, w1/w3/w2 =
    gate/up/down, norms renamed, tok_embeddings -> model.embed_tokens, output -> lm_head."""
    sd, cfg = model.state_dict(), model.config
    d = cfg.dim
    out = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.cls_embedding.cap_proj.fc1.weight": sd["cls_embedding.cap_proj.fc1.weight"],
        "model.cls_embedding.cap_proj.fc2.weight": sd["cls_embedding.cap_proj.fc2.weight"],
        "model.cls_embedding.uncond_embedding": sd["cls_embedding.uncond_embedding"],
        "model.norm.weight": sd["norm.weight"],
        "lm_head.weight": sd["output.weight"],
    }
    for i in range(cfg.n_layer):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        wqkv = sd[src + "attention.wqkv.weight"]
        out[dst + "self_attn.q_proj.weight"] = wqkv[:d]
        out[dst + "self_attn.k_proj.weight"] = wqkv[d:2 * d]
        out[dst + "self_attn.v_proj.weight"] = wqkv[2 * d:]
        out[dst + "self_attn.o_proj.weight"] = sd[src + "attention.wo.weight"]
        out[dst + "mlp.gate_proj.weight"] = sd[src + "feed_forward.w1.weight"]
        out[dst + "mlp.up_proj.weight"] = sd[src + "feed_forward.w3.weight"]
        out[dst + "mlp.down_proj.weight"] = sd[src + "feed_forward.w2.weight"]
        out[dst + "input_layernorm.weight"] = sd[src + "attention_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "ffn_norm.weight"]
    return {k: v.clone().contiguous() for k, v in out.items()}


def hf_config(cfg: GPTConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim, "num_attention_heads": cfg.n_head, "num_hidden_layers": cfg.n_layer,
        "num_key_value_heads": cfg.n_head, "rms_norm_eps": cfg.norm_eps, "vocab_size": cfg.vocab_size,
        "block_size": cfg.grid_h * cfg.grid_w, "cls_token_num": cfg.cls_token_num, "caption_dim": cfg.caption_dim,
        "rope_base": cfg.rope_base, "input_type": "t2i", "class_dropout_p": 0.0, "torch_dtype": "float32",
    }


def write_llamagen_hf(model: LlamaGenGPT, d: Path, shards: int = 1, state: dict | None = None) -> Path:
    """config.json + model.safetensors (or model-0000i-of-0000n.safetensors + index.json)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config(model.config), indent=2))
    state = hf_state(model) if state is None else state
    if shards == 1:
        save_file(state, str(d / "model.safetensors"))
        return d
    keys = sorted(state)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[s::shards]}
        save_file(part, str(d / name))
        weight_map.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def tiny_vq(seed: int = 0) -> VQModel:
    torch.manual_seed(seed)
    m = VQModel(TINY_VQ).eval()
    with torch.no_grad():
        m.quantize.codebook_used.copy_(torch.randint(0, TINY_VQ.codebook_size, (65536,)).float())
    return m


def write_vq_pt(model: VQModel, path: Path, drop: str | None = None) -> Path:
    """LlamaGen VQ checkpoint: {"model": sd, "optimizer", "discriminator", "steps", "args"}."""
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != drop}
    torch.save({"model": sd, "optimizer": {}, "discriminator": {"w": torch.zeros(2)}, "steps": 1,
                "args": argparse.Namespace(vq_model="VQ-16", codebook_size=model.cfg.codebook_size)}, path)
    return path


def lantern_config(target: GPTConfig, input_type: str = "t2i") -> dict:
    """LANTERN's drafter config.json (data/configs/llamagen_t2i_config.json) at the target's widths."""
    return {
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": target.dim, "caption_dim": target.caption_dim, "class_dropout_p": 0.0,
        "initializer_range": 0.02, "intermediate_size": target.ffn_dim, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": target.n_head, "num_hidden_layers": 1,
        "num_key_value_heads": target.n_head, "pretraining_tp": 1, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": True, "vocab_size": target.vocab_size,
        "input_type": input_type,
    }


def tiny_drafter(target: GPTConfig = TINY_GPT, seed: int = 1) -> Drafter:
    torch.manual_seed(seed)
    return Drafter(DrafterConfig.for_target(target)).eval()


def write_lantern_drafter(model: Drafter, d: Path, target: GPTConfig = TINY_GPT, fmt: str = "bin",
                          state: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(lantern_config(target), indent=2))
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()} if state is None else state
    if fmt == "bin":
        torch.save(state, d / "pytorch_model.bin")
    else:
        save_file(state, str(d / "model.safetensors"))
    return d


def logits_of(model: LlamaGenGPT, seed: int = 0) -> torch.Tensor:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    t, n = cfg.cls_token_num, 5
    cap = torch.randn(2, t, cfg.caption_dim, generator=g)
    toks = torch.randint(0, cfg.vocab_size, (2, n), generator=g)
    mask = torch.ones(t + n, t + n, dtype=torch.bool).tril()[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        logits, _ = model(torch.arange(t + n), mask, None, tokens=toks, captions=cap)
    return logits


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- LlamaGen GPT: original checkpoints ------------------------------------------------------
@pytest.mark.parametrize("wrapper,prefix", [("model", ""), ("module", "module."), ("state_dict", "_orig_mod."),
                                            ("model", "module._orig_mod.")])
def test_original_checkpoint_loads(tmp_path, wrapper, prefix):
    src = tiny_gpt()
    path = write_llamagen_pt(src, tmp_path / "ckpt.pt", wrapper, prefix)
    m = load_llamagen_gpt(path, n_head=4)
    assert m.config == TINY_GPT  # grid from args.image_size // args.downsample_size
    assert same_weights(m, src)
    assert torch.equal(logits_of(m), logits_of(src))


def test_plain_state_dict_and_heads_from_args(tmp_path):
    src = tiny_gpt()
    torch.save(src.state_dict(), tmp_path / "fsdp.pt")  # FSDP saves: no wrapper, no args
    with pytest.raises(CheckpointError, match="n_head"):
        load_llamagen_gpt(tmp_path / "fsdp.pt", grid=4)
    with pytest.raises(CheckpointError, match="grid"):
        load_llamagen_gpt(tmp_path / "fsdp.pt", n_head=4)
    assert load_llamagen_gpt(tmp_path / "fsdp.pt", grid=4, n_head=4).config == TINY_GPT
    # a published size name in args gives the heads: GPT-XL has 20, which 64 wide cannot split into
    path = write_llamagen_pt(src, tmp_path / "xl.pt", args=llamagen_args(TINY_GPT, "GPT-XL"))
    with pytest.raises(CheckpointError, match="into 20 heads"):
        load_llamagen_gpt(path)


def test_arbitrary_pickled_objects_are_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    ckpt = {"model": tiny_gpt().state_dict(), "payload": Evil()}
    torch.save(ckpt, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_llamagen_gpt(tmp_path / "evil.pt", n_head=4)


# ---- LlamaGen GPT: HF-converted layout -------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 3])
def test_original_and_hf_layouts_give_identical_logits(tmp_path, shards):
    src = tiny_gpt()
    orig = load_llamagen_gpt(write_llamagen_pt(src, tmp_path / "t2i.pt"), n_head=4)
    hf = load_llamagen_gpt(write_llamagen_hf(src, tmp_path / "LlamaGen-T2I", shards=shards))
    assert hf.config == orig.config == TINY_GPT
    assert same_weights(hf, orig)
    assert torch.equal(logits_of(hf), logits_of(orig))


def test_hf_names_cover_every_parameter_of_xl():
    cfg = GPTConfig.llamagen("XL")
    names = hf_gpt_names(cfg)
    with torch.device("meta"):
        ours = LlamaGenGPT(cfg).state_dict()
    assert len(names) == 36 * 9 + 6
    assert {our for our, _ in names.values()} == set(ours)
    assert sum(torch.Size(s).numel() for _, s in names.values()) == 777_678_080 + 245_760


# ---- refusals that name the keys -------------------------------------------------------------
def test_missing_uncond_embedding_is_refused(tmp_path):
    src = tiny_gpt()
    sd = {k: v for k, v in src.state_dict().items() if k != "cls_embedding.uncond_embedding"}
    torch.save({"model": sd, "args": llamagen_args(TINY_GPT)}, tmp_path / "no_uncond.pt")
    with pytest.raises(CheckpointError, match="cls_embedding.uncond_embedding.*refused"):
        load_llamagen_gpt(tmp_path / "no_uncond.pt", n_head=4)
    hf = hf_state(src)
    del hf["model.cls_embedding.uncond_embedding"]
    with pytest.raises(CheckpointError, match="model.cls_embedding.uncond_embedding.*refused"):
        load_llamagen_gpt(write_llamagen_hf(src, tmp_path / "hf", state=hf))


def test_missing_misshaped_and_unexpected_keys_are_named(tmp_path):
    sd = tiny_gpt().state_dict()
    del sd["layers.1.feed_forward.w2.weight"]
    sd["norm.weight"] = torch.ones(65)
    sd["layers.0.attention.lora_a"] = torch.zeros(3)
    torch.save({"model": sd, "args": llamagen_args(TINY_GPT)}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        load_llamagen_gpt(tmp_path / "bad.pt", n_head=4)
    msg = str(e.value)
    assert "missing keys: layers.1.feed_forward.w2.weight" in msg
    assert "misshaped keys: norm.weight (65,) (expected (64,))" in msg
    assert "unexpected keys: layers.0.attention.lora_a" in msg


def test_hf_missing_and_misshaped_keys_are_named_in_hf_terms(tmp_path):
    src = tiny_gpt()
    hf = hf_state(src)
    del hf["model.layers.1.self_attn.k_proj.weight"]
    hf["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    with pytest.raises(CheckpointError) as e:
        load_llamagen_gpt(write_llamagen_hf(src, tmp_path / "hf", state=hf))
    assert "missing keys: model.layers.1.self_attn.k_proj.weight" in str(e.value)
    assert "model.layers.0.mlp.down_proj.weight (64, 100) (expected (64, 192))" in str(e.value)


def test_not_a_checkpoint_is_named(tmp_path):
    torch.save({"optimizer": {}, "steps": 3}, tmp_path / "opt.pt")
    with pytest.raises(CheckpointError, match="no weights found.*optimizer"):
        load_llamagen_gpt(tmp_path / "opt.pt", grid=4, n_head=4)


# ---- config inference against the real configs (meta tensors: no weights) ----------------------
def test_config_inference_matches_real_xl_and_vq16():
    xl = GPTConfig.llamagen("XL")
    with torch.device("meta"):
        gpt_sd = LlamaGenGPT(xl).state_dict()
        vq_sd = VQModel(VQConfig.vq16()).state_dict()
    assert infer_gpt_config(gpt_sd, grid=16) == xl  # heads from the known LlamaGen widths
    assert infer_gpt_config(gpt_sd, args=argparse.Namespace(gpt_model="GPT-XL", image_size=512, downsample_size=16)) \
        == GPTConfig.llamagen("XL", grid=32)
    assert infer_vq_config(vq_sd) == VQConfig.vq16()
    # LANTERN's published drafter config for LlamaGen stage 1 -> our drafter for the XL target
    lantern = lantern_config(xl)
    assert lantern["intermediate_size"] == 3584 and lantern["hidden_size"] == 1280
    assert drafter_config_from_lantern(lantern, xl) == dataclasses.replace(DrafterConfig.for_target(xl), caption_pairs=True)


def test_unwrap_prefers_model_then_module_then_state_dict():
    a, b = {"x": torch.zeros(1)}, {"y": torch.zeros(1)}
    assert set(unwrap_state_dict({"module": b, "model": a})) == {"x"}
    assert set(unwrap_state_dict({"state_dict": a, "module": b})) == {"y"}


# ---- VQ ----------------------------------------------------------------------------------
def test_vq_checkpoint_loads_strictly_with_codebook_used(tmp_path):
    src = tiny_vq()
    m = load_vq(write_vq_pt(src, tmp_path / "vq_ds16_t2i.pt"))
    assert m.cfg == TINY_VQ
    assert same_weights(m, src)
    codes = torch.randint(0, 32, (1, 4, 4))
    assert torch.equal(m.decode(codes), src.decode(codes))


def test_vq_without_codebook_used_is_refused(tmp_path):
    path = write_vq_pt(tiny_vq(), tmp_path / "vq.pt", drop="quantize.codebook_used")
    with pytest.raises(CheckpointError, match="missing keys: quantize.codebook_used"):
        load_vq(path)


# ---- LANTERN drafter ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_lantern_drafter_loads(tmp_path, fmt):
    src = tiny_drafter()
    assert len(src.state_dict()) == 11
    m = load_lantern_drafter(write_lantern_drafter(src, tmp_path / "llamagen_drafter", fmt=fmt), TINY_GPT)
    assert m.config == dataclasses.replace(DrafterConfig.for_target(TINY_GPT), caption_pairs=True)
    assert same_weights(m, src)


def test_lantern_drafter_key_errors_are_named(tmp_path):
    sd = {k: v.clone() for k, v in tiny_drafter().state_dict().items()}
    del sd["fc.bias"]
    sd["layers.0.input_layernorm.weight"] = torch.ones(64)  # EAGLE's first layer has none
    with pytest.raises(CheckpointError) as e:
        load_lantern_drafter(write_lantern_drafter(tiny_drafter(), tmp_path / "d", state=sd), TINY_GPT)
    assert "missing keys: fc.bias" in str(e.value)
    assert "unexpected keys: layers.0.input_layernorm.weight" in str(e.value)


def test_lantern_drafter_must_match_the_target(tmp_path):
    d = write_lantern_drafter(tiny_drafter(), tmp_path / "d")
    other = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=40, cls_token_num=8, caption_dim=16, grid_h=4,
                      grid_w=4, multiple_of=64)
    with pytest.raises(CheckpointError, match="do not match the target"):
        load_lantern_drafter(d, other)
