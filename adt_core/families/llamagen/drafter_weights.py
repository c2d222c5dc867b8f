"""Loaders of LlamaGen draft heads: LANTERN's published drafters and this project's own
drafter export, told apart by their config.json.

    LANTERN drafter   DIR/config.json (LlamaConfig fields: "hidden_size", ...) +
                      DIR/pytorch_model.bin | DIR/model.safetensors, 11 keys.
    project drafter   DIR/config.json (DrafterConfig fields: "dim", "n_head", ...) +
                      DIR/model.safetensors: what jobs.train_drafter exports (OUT/drafter)
                      and bundle directories hold; read by the same entry point.

Both run on the target's sequence, so each is checked against the target's GPTConfig (width,
vocabulary; grid and caption rows for the project's export). Files are read and checked with
checkpoints.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from adt_core.families.weights import (
    CheckpointError, cast_floats, check_state, module_shapes, read_weights, unwrap_state_dict,
)
from adt_core.families.llamagen.drafter import Drafter, DrafterConfig
from adt_core.families.llamagen.model import GPTConfig

log = logging.getLogger(__name__)

LANTERN_GRIDS = {"t2i": 16, "t2i2": 32}  # LANTERN drafter config "input_type" -> grid side


# ---- LANTERN drafter ---------------------------------------------------------------------
DRAFTER_KEYS = (
    "embed_tokens.weight", "fc.weight", "fc.bias",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
)


def drafter_config_from_lantern(config: Mapping[str, Any], target: GPTConfig,
                                source: str = "config.json") -> DrafterConfig:
    """DrafterConfig from LANTERN's drafter config.json; grid, caption rows and RoPE base are
    the target's (the drafter runs on the target's sequence)."""
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        ffn, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    except KeyError as e:
        raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"{source}: num_hidden_layers {config['num_hidden_layers']} (LANTERN drafters have 1)")
    if int(config.get("num_key_value_heads") or heads) != heads:
        raise CheckpointError(f"{source}: num_key_value_heads != num_attention_heads (no GQA supported)")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {config['hidden_act']!r} (expected silu)")
    if (dim, vocab) != (target.dim, target.vocab_size):
        raise CheckpointError(f"{source}: drafter width/vocab {dim}/{vocab} do not match the target's "
                              f"{target.dim}/{target.vocab_size}")
    side = LANTERN_GRIDS.get(str(config.get("input_type")))
    if side is not None and (side, side) != (target.grid_h, target.grid_w):
        log.warning("%s: drafter trained for grid %d (input_type %s), target grid is %dx%d",
                    source, side, config.get("input_type"), target.grid_h, target.grid_w)
    return DrafterConfig(dim=dim, n_head=heads, ffn_dim=ffn, vocab_size=vocab, cls_token_num=target.cls_token_num,
                         grid_h=target.grid_h, grid_w=target.grid_w,
                         norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_base=target.rope_base,
                         caption_pairs=True)  # LANTERN feeds (code 0, h_j) for caption positions


def load_lantern_drafter(path: str | Path, target: GPTConfig, dtype: torch.dtype = torch.float32) -> Drafter:
    """Load a LANTERN / EAGLE drafter: a directory with config.json and pytorch_model.bin or
    model.safetensors (or one of those files with config.json beside it). A config.json of
    DrafterConfig fields (this project's own format: jobs.train_drafter's export) is read as
    that, checked against the target."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{d}: a LANTERN drafter needs config.json")
    config = json.loads(cfg_file.read_text())
    if "dim" in config and "hidden_size" not in config:
        return _load_project_drafter(d, config, target, dtype, str(cfg_file))
    if path.is_dir():
        names = ("model.safetensors", "pytorch_model.bin")
        found = [d / n for n in names if (d / n).is_file()]
        if not found:
            raise FileNotFoundError(f"{d}: no model.safetensors or pytorch_model.bin")
        path = found[0]
    state = unwrap_state_dict(read_weights(path), str(path))
    cfg = drafter_config_from_lantern(config, target, str(cfg_file))
    if "fc.bias" not in state and config.get("bias") is False:
        state["fc.bias"] = torch.zeros(cfg.dim)  # trained without a bias: same function
    check_state(state, module_shapes(lambda: Drafter(cfg)), str(path))
    model = Drafter(cfg)
    model.load_state_dict(cast_floats(state, dtype), strict=True)
    return model.eval()


# ---- the project's drafter export -------------------------------------------------------
def _load_project_drafter(d: Path, config: Mapping[str, Any], target: GPTConfig, dtype: torch.dtype,
                          source: str) -> Drafter:
    """DIR/config.json (DrafterConfig fields) + DIR/model.safetensors, strict; the drafter must
    run on the target's sequence (width, vocabulary, grid, caption rows)."""
    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    unknown = set(config) - names
    if unknown:
        raise CheckpointError(f"{source}: unknown fields {sorted(unknown)} (DrafterConfig: {sorted(names)})")
    try:
        cfg = DrafterConfig(**config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None
    mine = (cfg.dim, cfg.vocab_size, cfg.grid_h, cfg.grid_w, cfg.cls_token_num)
    theirs = (target.dim, target.vocab_size, target.grid_h, target.grid_w, target.cls_token_num)
    if mine != theirs:
        raise CheckpointError(f"{source}: drafter (width, vocab, grid, caption rows) {mine} does not match "
                              f"the target's {theirs}")
    weights = d / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{d}: no model.safetensors")
    state = read_weights(weights)
    check_state(state, module_shapes(lambda: Drafter(cfg)), str(weights))
    model = Drafter(cfg)
    model.load_state_dict(cast_floats(state, dtype), strict=True)
    return model.eval()
