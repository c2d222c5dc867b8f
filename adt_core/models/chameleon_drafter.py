"""LANTERN's drafter for Chameleon targets, and LANTERN's codebook neighbour table.

One input pair per sequence position p: the embedding of the id at p (a code's id or a forced
token's) and the target's post-norm hidden state at p - 1. Then

    x = fc(concat(embed(id_p), h_{p-1}))        # (R, S, 2H) -> (R, S, H), with bias
    f = ChameleonDecoderLayer(x)                # WITH input_layernorm and q/k LayerNorm, 1-D RoPE
    logits = target.head(f)                     # no final norm; the target's lm_head (codes)

Unlike the LlamaGen drafter (adt_core/models/drafter.py) the layer keeps its input norm and
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

import numpy as np
import torch
from torch import nn

from adt_core.kv_cache import KVCache
from adt_core.models.chameleon import ChameleonConfig, ChameleonTarget, DecoderLayer, rope_cos_sin
from adt_core.models.checkpoints import CheckpointError, check_state, torch_load, unwrap_state_dict

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
NUM_TENSORS = 16  # what a LANTERN Chameleon drafter checkpoint holds


class ChameleonDrafter(nn.Module):
    def __init__(self, cfg: ChameleonConfig) -> None:
        super().__init__()
        if cfg.num_hidden_layers != 1:
            raise ValueError(f"LANTERN drafters have one layer, not {cfg.num_hidden_layers}")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache:
        p, c = self.fc.weight, self.config
        return KVCache(1, rows, c.num_key_value_heads, c.head_dim, max_len, device or p.device, dtype or p.dtype)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens (R, S) ids at `positions` (R, S) or (S,); hidden (R, S, H) = target state one
        position earlier; mask (R, 1, S, K) bool. Returns features (R, S, H) for target.head."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden.to(self.fc.weight.dtype)], dim=-1))
        if positions.dim() == 1:
            positions = positions[None].expand(x.shape[0], -1)
        rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.layers[0](x, rope, mask, cache, 0)
        if cache is not None:
            cache.advance(x.shape[1])
        return x


def _weights_file(d: Path) -> Path:
    found = [d / n for n in WEIGHT_FILES if (d / n).is_file()]
    if not found:
        raise CheckpointError(f"{d}: no {' or '.join(WEIGHT_FILES)}")
    return found[0]


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return unwrap_state_dict(torch_load(path), str(path))


def load_chameleon_drafter(path: str | Path, target: ChameleonTarget | ChameleonConfig | None = None,
                           dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> ChameleonDrafter:
    """A LANTERN Chameleon drafter from DIR (config.json + model.safetensors | pytorch_model.bin,
    the latter read with weights_only=True). Strict: exactly the 16 tensors, each in shape; a
    target (model or config), when given, must match width, heads and vocabulary."""
    d = Path(path)
    d = d if d.is_dir() else d.parent
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{d}: a LANTERN drafter needs config.json")
    weights = _weights_file(d)
    config = json.loads(cfg_file.read_text())
    state = _read(weights)
    if "fc.bias" not in state and config.get("bias") is False:
        state["fc.bias"] = torch.zeros(int(config["hidden_size"]))  # trained without a bias: the same function
    q_norm = state.get("layers.0.self_attn.q_norm.weight")  # [g, hd]: g from the file (else the check names it)
    groups = int(q_norm.shape[0]) if q_norm is not None and q_norm.dim() == 2 else None
    cfg = ChameleonConfig.from_hf({**config, "num_hidden_layers": 1}, groups, str(cfg_file))
    _check_target(cfg, target, str(cfg_file))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in ChameleonDrafter(cfg).state_dict().items()}
    check_state(state, expected, str(weights))
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


def load_neighbours(path: str | Path, k: int | None = None, num_codes: int | None = None) -> torch.Tensor:
    """LANTERN's top_{V-1}_indices.npy -> (V, k) long codes, nearest first (row c: code c's
    neighbours), the `neighbours` of adt_core.verify.Relaxation. Read memory-mapped: only the
    first k columns are copied (the 8192 x 8191 table is 134 MB as uint16)."""
    p = Path(path)
    table = np.load(p, mmap_mode="r", allow_pickle=False)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
        raise CheckpointError(f"{p}: expected a 2-D integer table, got {table.dtype} {table.shape}")
    v, width = table.shape
    if num_codes is not None and v != num_codes:
        raise CheckpointError(f"{p}: {v} rows, the codebook has {num_codes} codes")
    k = width if k is None else k
    if not 1 <= k <= width:
        raise CheckpointError(f"{p}: {width} neighbours per code, {k} asked")
    out = torch.from_numpy(np.ascontiguousarray(table[:, :k]).astype(np.int64))
    if int(out.min()) < 0 or int(out.max()) >= v:
        raise CheckpointError(f"{p}: codes outside 0..{v - 1}")
    if bool((out == torch.arange(v)[:, None]).any()):
        raise CheckpointError(f"{p}: a code lists itself as a neighbour")
    return out
