"""Loaders for LlamaGen's published checkpoints: the text-to-image GPT and the VQ tokenizer.

Layouts read (facts: ../shared/design/model_formats.md):

    LlamaGen GPT, original    t2i_XL_stage1_256.pt = {"model" | "module" | "state_dict": sd,
                              "optimizer", "steps", "args"}; "module." / "_orig_mod." prefixes;
                              freqs_cis and kv-cache buffers ignored. Keys = LlamaGenGPT's.
    LlamaGen GPT, HF-converted  DIR/config.json + DIR/model.safetensors (LANTERN's LlamaGen-T2I):
                              model.embed_tokens, model.cls_embedding.*, model.layers.N.self_attn.
                              {q,k,v,o}_proj (q|k|v = plain row split of wqkv), model.layers.N.mlp.
                              {gate,up,down}_proj (= w1, w3, w2), input_layernorm /
                              post_attention_layernorm, model.norm, lm_head.
    LlamaGen VQ               vq_ds16_t2i.pt = {"model": sd, ...}; strict, incl. quantize.codebook_used.

Where a file has no config, the architecture is inferred from tensor shapes (widths, layers,
vocabulary, caption rows); what shapes cannot tell (heads, grid) comes from LlamaGen's "args",
the known LlamaGen sizes, or the caller. Files are read and checked with checkpoints.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from adt_core.families.weights import (
    CheckpointError, cast_floats, check_state, checkpoint_args, key_list, module_shapes, read_safetensors,
    read_weights, unwrap_state_dict,
)
from adt_core.families.layers import RopeTable
from adt_core.families.llamagen.model import GPTConfig, LlamaGenGPT
from adt_core.families.vqgan import VQConfig, VQModel, infer_vq_config  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

LLAMAGEN_HEADS = {768: 12, 1024: 16, 1280: 20, 1536: 24, 2048: 32, 2560: 40, 3200: 32, 4096: 32}  # dim -> heads
LLAMAGEN_SIZES = {"GPT-B": 12, "GPT-L": 16, "GPT-XL": 20, "GPT-XXL": 24, "GPT-XXXL": 40,
                  "GPT-1B": 32, "GPT-3B": 32, "GPT-7B": 32}  # args.gpt_model -> heads
UNCOND_KEY = "cls_embedding.uncond_embedding"


# ---- LlamaGen GPT ------------------------------------------------------------------------
def _ffn_config(dim: int, ffn: int) -> dict:
    """GPTConfig fields that give an FFN width `ffn` for `dim` (LlamaGen rounds 8*dim/3 up)."""
    for mult in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if GPTConfig(dim=dim, multiple_of=mult).ffn_dim == ffn:
            return {"multiple_of": mult}
    raise CheckpointError(f"FFN width {ffn} is not LlamaGen's rounding of 8*{dim}/3 for any multiple_of")


def _grid_pair(grid: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(grid, int):
        return grid, grid
    h, w = grid
    return int(h), int(w)


def _square_grid(block_size: int, source: str) -> int:
    side = math.isqrt(int(block_size))
    if side * side != block_size:
        raise CheckpointError(f"{source}: block_size {block_size} is not a square grid")
    return side


def infer_gpt_config(
    state: Mapping[str, torch.Tensor],
    args: argparse.Namespace | None = None,
    grid: int | tuple[int, int] | None = None,
    n_head: int | None = None,
    source: str = "checkpoint",
) -> GPTConfig:
    """A GPTConfig from an original-layout state dict: widths, layers, vocabulary and caption
    rows from shapes; heads from `n_head`, args.gpt_model or the known LlamaGen sizes; grid
    from `grid` or args.image_size // args.downsample_size."""
    need = ["tok_embeddings.weight", "cls_embedding.cap_proj.fc1.weight", UNCOND_KEY, "layers.0.feed_forward.w1.weight"]
    _refuse_missing_uncond(state, UNCOND_KEY, source)
    absent = [k for k in need if k not in state]
    if absent:
        raise CheckpointError(f"{source}: not a LlamaGen GPT state dict, missing keys: {key_list(absent)}")
    vocab, dim = state["tok_embeddings.weight"].shape
    layers = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    n_layer = max(layers) + 1
    cls_num, caption_dim = state[UNCOND_KEY].shape
    ffn = state["layers.0.feed_forward.w1.weight"].shape[0]
    if n_head is None and args is not None:
        n_head = LLAMAGEN_SIZES.get(str(getattr(args, "gpt_model", "")))
    if n_head is None:
        n_head = LLAMAGEN_HEADS.get(int(dim))
    if n_head is None:
        raise CheckpointError(f"{source}: width {dim} is not a LlamaGen size; give n_head (e.g. in the manifest)")
    if dim % n_head or (dim // n_head) % 4:
        raise CheckpointError(f"{source}: width {dim} does not split into {n_head} heads with a head size "
                              "divisible by 4 (2-D RoPE); check n_head / args.gpt_model")
    if args is not None and getattr(args, "image_size", None) and getattr(args, "downsample_size", None):
        trained = args.image_size // args.downsample_size
        if grid is None:
            grid = trained
        elif _grid_pair(grid) != (trained, trained):
            log.warning("%s: trained at grid %d, loading with grid %s", source, trained, grid)
    if grid is None:
        raise CheckpointError(f"{source}: the grid size is not stored in the weights; "
                              "give grid (16 at 256 px, 32 at 512 px)")
    h, w = _grid_pair(grid)
    return GPTConfig(dim=int(dim), n_layer=n_layer, n_head=int(n_head), vocab_size=int(vocab),
                     cls_token_num=int(cls_num), caption_dim=int(caption_dim), grid_h=h, grid_w=w,
                     **_ffn_config(int(dim), int(ffn)))


def gpt_config_from_hf(config: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                       grid: int | tuple[int, int] | None = None, source: str = "config.json") -> GPTConfig:
    """A GPTConfig from an HF-converted LlamaGen config.json (LANTERN's LlamaGen-T2I)."""
    try:
        dim, n_layer = int(config["hidden_size"]), int(config["num_hidden_layers"])
        n_head = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
    except KeyError as e:
        raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None
    kv_heads = int(config.get("num_key_value_heads") or n_head)
    if kv_heads != n_head:
        raise CheckpointError(f"{source}: num_key_value_heads {kv_heads} != num_attention_heads {n_head} "
                              "(LlamaGen has no GQA)")
    ffn = int(config.get("intermediate_size") or GPTConfig(dim=dim).ffn_dim)
    uncond = state.get(f"model.{UNCOND_KEY}")
    cls_num = int(config.get("cls_token_num") or (uncond.shape[0] if uncond is not None else 120))
    caption_dim = int(config.get("caption_dim") or (uncond.shape[1] if uncond is not None else 2048))
    if grid is None:
        if not config.get("block_size"):
            raise CheckpointError(f"{source}: no block_size; give grid")
        grid = _square_grid(int(config["block_size"]), source)
    elif config.get("block_size") and _grid_pair(grid) != (_square_grid(int(config["block_size"]), source),) * 2:
        log.warning("%s: block_size %s, loading with grid %s", source, config["block_size"], grid)
    h, w = _grid_pair(grid)
    return GPTConfig(
        dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=vocab, cls_token_num=cls_num, caption_dim=caption_dim,
        grid_h=h, grid_w=w, norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_base=float(config.get("rope_base") or config.get("rope_theta") or 10000.0), **_ffn_config(dim, ffn),
    )


def hf_gpt_names(cfg: GPTConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF-converted key -> (LlamaGen key, shape). q/k/v map to row thirds of wqkv."""
    d, f = cfg.dim, cfg.ffn_dim
    names = {
        "model.embed_tokens.weight": ("tok_embeddings.weight", (cfg.vocab_size, d)),
        "model.cls_embedding.cap_proj.fc1.weight": ("cls_embedding.cap_proj.fc1.weight", (d, cfg.caption_dim)),
        "model.cls_embedding.cap_proj.fc2.weight": ("cls_embedding.cap_proj.fc2.weight", (d, d)),
        f"model.{UNCOND_KEY}": (UNCOND_KEY, (cfg.cls_token_num, cfg.caption_dim)),
        "model.norm.weight": ("norm.weight", (d,)),
        "lm_head.weight": ("output.weight", (cfg.vocab_size, d)),
    }
    ours = {"self_attn.q_proj": "attention.wqkv", "self_attn.k_proj": "attention.wqkv",
            "self_attn.v_proj": "attention.wqkv", "self_attn.o_proj": "attention.wo",
            "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
            "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, d), "self_attn.v_proj": (d, d),
              "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f),
              "input_layernorm": (d,), "post_attention_layernorm": (d,)}
    for i in range(cfg.n_layer):
        for hf, our in ours.items():
            names[f"model.layers.{i}.{hf}.weight"] = (f"layers.{i}.{our}.weight", shapes[hf])
    return names


def hf_to_llamagen(state: Mapping[str, torch.Tensor], cfg: GPTConfig,
                   source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Rename an HF-converted state dict to LlamaGen keys (q|k|v rows concatenated into wqkv)."""
    names = hf_gpt_names(cfg)
    _refuse_missing_uncond(state, f"model.{UNCOND_KEY}", source)
    check_state(state, {k: s for k, (_, s) in names.items()}, source)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}.self_attn."
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat([state[p + "q_proj.weight"], state[p + "k_proj.weight"],
                                                             state[p + "v_proj.weight"]], dim=0)
    for hf, (our, _) in names.items():
        if our not in out:
            out[our] = state[hf]
    return out


def _refuse_missing_uncond(state: Mapping[str, torch.Tensor], key: str, source: str) -> None:
    if key not in state:
        raise CheckpointError(
            f"{source}: missing key {key}: the unconditional caption is a buffer that only the checkpoint "
            "holds; without it classifier-free guidance would use random noise, so the checkpoint is refused"
        )


def is_hf_layout(state: Mapping[str, torch.Tensor]) -> bool:
    return "lm_head.weight" in state or any(k.startswith("model.layers.") for k in state)


def build_gpt(cfg: GPTConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
              source: str = "checkpoint") -> LlamaGenGPT:
    """Check `state` (LlamaGen keys) against LlamaGenGPT(cfg) and load it, without a random init.

    The model is built on the meta device and the checkpoint tensors are assigned; the RoPE
    table (not a buffer) is then rebuilt on the CPU."""
    _refuse_missing_uncond(state, UNCOND_KEY, source)
    check_state(state, module_shapes(lambda: LlamaGenGPT(cfg)), source)
    with torch.device("meta"):
        model = LlamaGenGPT(cfg)
    model.load_state_dict(cast_floats(state, dtype), strict=True, assign=True)
    model.rope = RopeTable(cfg.grid_h, cfg.grid_w, cfg.cls_token_num, cfg.head_dim, cfg.rope_base)
    _no_meta(model, source)
    return model.eval()


def _no_meta(model: nn.Module, source: str) -> None:
    left = [k for k, v in list(model.named_parameters()) + list(model.named_buffers()) if v.is_meta]
    if left:
        raise CheckpointError(f"{source}: tensors left unloaded: {key_list(left)}")


def _hf_weights_file(d: Path) -> Path:
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")



def load_llamagen_gpt(
    path: str | Path,
    grid: int | tuple[int, int] | None = None,
    n_head: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> LlamaGenGPT:
    """Load a LlamaGen text-to-image GPT from an original training checkpoint (.pt), a
    safetensors file with LlamaGen keys, or an HF-converted directory (config.json + weights).

    grid: image-token grid side (or (H, W)); needed when the file does not say it.
    n_head: attention heads; needed only for widths that are not LlamaGen sizes.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: an HF-converted LlamaGen directory needs config.json")
        config = json.loads((path / "config.json").read_text())
        wfile = _hf_weights_file(path)
        state = unwrap_state_dict(read_weights(wfile), str(wfile))
        if not is_hf_layout(state):
            cfg = infer_gpt_config(state, None, grid or _config_grid(config), n_head, str(wfile))
            return build_gpt(cfg, state, dtype, str(wfile))
        cfg = gpt_config_from_hf(config, state, grid, str(path / "config.json"))
        return build_gpt(cfg, hf_to_llamagen(state, cfg, str(wfile)), dtype, str(wfile))
    raw = read_weights(path)
    state = unwrap_state_dict(raw, str(path))
    if is_hf_layout(state):
        cfg_file = path.parent / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: HF-converted keys but no config.json beside it")
        cfg = gpt_config_from_hf(json.loads(cfg_file.read_text()), state, grid, str(cfg_file))
        return build_gpt(cfg, hf_to_llamagen(state, cfg, str(path)), dtype, str(path))
    cfg = infer_gpt_config(state, checkpoint_args(raw), grid, n_head, str(path))
    return build_gpt(cfg, state, dtype, str(path))


def _config_grid(config: Mapping[str, Any]) -> int | None:
    return _square_grid(int(config["block_size"]), "config.json") if config.get("block_size") else None


# ---- LlamaGen VQ -------------------------------------------------------------------------
def load_vq(path: str | Path, config: VQConfig | None = None, dtype: torch.dtype = torch.float32) -> VQModel:
    """Load a LlamaGen VQ tokenizer (vq_ds16_t2i.pt, or a directory written by vq.save_pretrained),
    strictly: every key of VQModel present with its shape, including quantize.codebook_used."""
    path = Path(path)
    if path.is_dir():
        wfile = path / "model.safetensors"
        if config is None and (path / "config.json").is_file():
            config = VQConfig.from_dict(json.loads((path / "config.json").read_text()))
        raw: Any = read_safetensors(wfile)
        source = str(wfile)
    else:
        raw, source = read_weights(path), str(path)
    state = unwrap_state_dict(raw, source)
    cfg = config or infer_vq_config(state, source)
    check_state(state, module_shapes(lambda: VQModel(cfg)), source)
    model = VQModel(cfg)
    model.load_state_dict(cast_floats(state, dtype), strict=True)
    return model.eval()
