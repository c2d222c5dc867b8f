"""The EAGLE-style drafter head for Janus targets, and the Janus family (target, drafter, decoder, prompter).

No public drafter exists for Janus-Pro; this is the head jobs.train_drafter trains. One input
pair per sequence position p: the target's input embedding of the id at p and the target's
post-norm hidden state at p - 1. Then

    x = fc(concat(target.embed(id_p), h_{p-1}))   # (R, S, 2H) -> (R, S, H), with bias
    x = x + attn(x)                               # no input norm (EAGLE's first layer)
    f = x + mlp(post_attention_layernorm(x))      # no final norm: f regresses h_p
    logits = target.head(f)                       # the target's gen_head (codes)

`target.embed` is the target's own input path: image code ids through gen_embed + gen_aligner
(text ids, if ever drafted from, through its text embedding). The drafter holds a reference to
the target, never a copy: the embedding and head stay the target's (frozen, on its device) and
are not in the drafter's parameters or state dict. RoPE: the target's 1-D rotate-half, at p.

Checkpoint (what jobs.train_drafter exports): DIR/config.json (`JanusDrafterConfig` fields) +
DIR/model.safetensors with exactly 10 tensors:

    fc.weight [H, 2H]   fc.bias [H]   layers.0.self_attn.{q,k,v,o}_proj.weight
    layers.0.mlp.{gate,up,down}_proj.weight   layers.0.post_attention_layernorm.weight [H]

"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from adt_core.families.janus.model import JanusConfig, JanusTarget, decoder_layer
from adt_core.families.layers import EagleHead, Rotary, half_rotary
from adt_core.families.weights import CheckpointError, check_state

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "janus_eagle_drafter"
NUM_TENSORS = 10


@dataclass(frozen=True)
class JanusDrafterConfig:
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_image_codes: int = 16384  # the target's V (its head's width), checked on load

    @classmethod
    def for_target(cls, t: JanusConfig, **kw) -> "JanusDrafterConfig":
        """The target's widths, heads, norm eps and RoPE (one layer of the target's shape)."""
        base = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                    num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                    rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, num_image_codes=t.num_image_codes)
        return cls(**{**base, **kw})

    def layer_config(self) -> JanusConfig:
        return JanusConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, num_image_codes=self.num_image_codes)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return {"model_type": MODEL_TYPE, "num_hidden_layers": 1, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = CONFIG_FILE) -> "JanusDrafterConfig":
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise CheckpointError(f"{source}: model_type {d['model_type']!r} (expected {MODEL_TYPE})")
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise CheckpointError(f"{source}: num_hidden_layers {d['num_hidden_layers']} (the drafter has 1)")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names - {"model_type", "num_hidden_layers"}
        if unknown:
            raise CheckpointError(f"{source}: unknown fields {sorted(unknown)}")
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from None


class JanusDrafter(EagleHead):
    def __init__(self, cfg: JanusDrafterConfig, target: JanusTarget) -> None:
        _check_target(cfg, target.config, "drafter config")
        super().__init__(cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim,
                         lambda: decoder_layer(cfg.layer_config(), input_norm=False))
        self.config = cfg
        self.__dict__["target"] = target  # a reference, not a submodule: not in parameters / state_dict

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """ids (R, S) (T + code for image codes) through the target's own input path."""
        return self.target.embed(tokens)

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return half_rotary(positions, self.config.head_dim, self.config.rope_theta)


def _check_target(cfg: JanusDrafterConfig, t: JanusConfig, source: str) -> None:
    mine = (cfg.hidden_size, cfg.num_attention_heads, cfg.rope_theta, cfg.num_image_codes)
    theirs = (t.hidden_size, t.num_attention_heads, t.rope_theta, t.num_image_codes)
    if mine != theirs:
        raise CheckpointError(f"{source}: drafter (hidden, heads, rope theta, codes) {mine} does not match "
                              f"the target's {theirs}")


def new_drafter(target: JanusTarget, seed: int | None = None, **kw) -> JanusDrafter:
    """A randomly initialised drafter for `target` (torch's default init; `seed` makes it reproducible),
    on the target's device and dtype."""
    if seed is not None:
        torch.manual_seed(seed)
    p = target.gen_embed.weight
    return JanusDrafter(JanusDrafterConfig.for_target(target.config, **kw), target).to(p.device, p.dtype)


def save_janus_drafter(drafter: JanusDrafter, directory: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """DIR/config.json + DIR/model.safetensors (the 10 drafter tensors in `dtype`)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()},
              str(d / WEIGHTS_FILE))
    (d / CONFIG_FILE).write_text(json.dumps(drafter.config.to_dict(), indent=2))
    return d


def load_janus_drafter(path: str | Path, target: JanusTarget | None = None, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> JanusDrafter:
    """A Janus drafter from DIR (config.json + model.safetensors) for `target` (required: the
    drafter embeds tokens and scores features with the target's own modules). Strict: exactly
    the 10 tensors, each in shape; config and target must agree."""
    from safetensors.torch import load_file

    d = Path(path)
    d = d if d.is_dir() else d.parent
    if target is None:
        raise CheckpointError(f"{d}: a Janus drafter needs its target (its embedding and head are the target's)")
    cfg_file, weights = d / CONFIG_FILE, d / WEIGHTS_FILE
    for f in (cfg_file, weights):
        if not f.is_file():
            raise CheckpointError(f"{d}: no {f.name}")
    cfg = JanusDrafterConfig.from_dict(json.loads(cfg_file.read_text()), str(cfg_file))
    _check_target(cfg, target.config, str(cfg_file))
    state = load_file(str(weights))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in JanusDrafter(cfg, target).state_dict().items()}
    check_state(state, expected, str(weights))
    model = JanusDrafter(cfg, target)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(device).eval()

