"""LANTERN's drafter for Chameleon targets, and LANTERN's codebook neighbour table.

One input pair per sequence position p: the embedding of the id at p (a code's id or a forced
token's) and the target's post-norm hidden state at p - 1. Then

    x = fc(concat(embed(id_p), h_{p-1}))        # (R, S, 2H) -> (R, S, H), with bias
    f = ChameleonDecoderLayer(x)                # WITH input_layernorm and q/k LayerNorm, 1-D RoPE
    logits = target.head(f)                     # no final norm; the target's lm_head (codes)

Unlike the LlamaGen drafter (adt_core/families/llamagen/drafter.py) the layer keeps its input norm and
has qk-norm. Checkpoint (jadohu/anole_drafter, sihwanpark/LANTERN-Lumina-mGPT-7B-768): config.json
(the target's, one layer) + model.safetensors or pytorch_model.bin with exactly 16 tensors:

    embed_tokens.weight [V, H] (a frozen copy of the target's)   fc.weight [H, 2H]   fc.bias [H]
    layers.0.self_attn.{q,k,v,o}_proj.weight   layers.0.self_attn.{q_norm,k_norm}.{weight,bias} [g, hd]
    layers.0.mlp.{gate,up,down}_proj.weight    layers.0.{input,post_attention}_layernorm.weight

Neighbour table: LANTERN's top_{V-1}_indices.npy, row c = the other codes by L2 distance of
the raw VQGAN codebook vectors, nearest first (uint16; indexed by code = id - 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from adt_core.families.chameleon.model import ChameleonConfig, ChameleonTarget, decoder_layer
from adt_core.families.layers import EagleHead, Rotary, half_rotary
from adt_core.families.weights import CheckpointError, check_state, torch_load, unwrap_state_dict
from adt_core.round.lantern import load_neighbours  # noqa: F401 - LANTERN's table, re-exported here

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
NUM_TENSORS = 16  # what a LANTERN Chameleon drafter checkpoint holds


class ChameleonDrafter(EagleHead):
    def __init__(self, cfg: ChameleonConfig) -> None:
        if cfg.num_hidden_layers != 1:
            raise ValueError(f"LANTERN drafters have one layer, not {cfg.num_hidden_layers}")
        super().__init__(cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, lambda: decoder_layer(cfg),
                         nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.config = cfg

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return half_rotary(positions, self.config.head_dim, self.config.rope_theta)


def _weights_file(d: Path) -> Path:
    found = [d / n for n in WEIGHT_FILES if (d / n).is_file()]
    if not found:
        raise CheckpointError(f"{d}: no {' or '.join(WEIGHT_FILES)}")
    return found[0]


def _read(path: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """The state dict; with meta, tensors of the right shape and no data (headers only)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        if not meta:
            return load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    return unwrap_state_dict(torch_load(path), str(path))  # memory-mapped


def load_chameleon_drafter(path: str | Path, target: ChameleonTarget | ChameleonConfig | None = None,
                           dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> ChameleonDrafter:
    """A LANTERN Chameleon drafter from DIR (config.json + model.safetensors | pytorch_model.bin,
    the latter read with weights_only=True). Strict: exactly the 16 tensors, each in shape; a
    target (model or config), when given, must match width, heads and vocabulary. On device
    "meta" the checks run on the safetensors header and the model holds no weights."""
    d = Path(path)
    d = d if d.is_dir() else d.parent
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{d}: a LANTERN drafter needs config.json")
    weights = _weights_file(d)
    config = json.loads(cfg_file.read_text())
    meta = torch.device(device).type == "meta"
    state = _read(weights, meta)
    if "fc.bias" not in state and config.get("bias") is False:
        state["fc.bias"] = torch.zeros(int(config["hidden_size"]), device=state["fc.weight"].device)  # trained without a bias: the same function
    q_norm = state.get("layers.0.self_attn.q_norm.weight")  # [g, hd]: g from the file (else the check names it)
    groups = int(q_norm.shape[0]) if q_norm is not None and q_norm.dim() == 2 else None
    cfg = ChameleonConfig.from_hf({**config, "num_hidden_layers": 1}, groups, str(cfg_file))
    _check_target(cfg, target, str(cfg_file))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in ChameleonDrafter(cfg).state_dict().items()}
    check_state(state, expected, str(weights))
    if meta:  # checked; no weights
        with torch.device("meta"):
            return ChameleonDrafter(cfg).to(dtype).eval()
    model = ChameleonDrafter(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(device).eval()


def _check_target(cfg: ChameleonConfig, target, source: str) -> None:
    if target is None:
        return
    t = target.config if isinstance(target, nn.Module) else target
    mine = (cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size, cfg.rope_theta)
    theirs = (t.hidden_size, t.num_attention_heads, t.vocab_size, t.rope_theta)
    if mine != theirs:
        raise CheckpointError(f"{source}: drafter (hidden, heads, vocab, rope theta) {mine} does not match "
                              f"the target's {theirs}")
