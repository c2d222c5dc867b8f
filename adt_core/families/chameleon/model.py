"""Chameleon-family target (Anole-7B, Lumina-mGPT-7B) with an explicit forward.

Architecture (transformers' models/chameleon, HF checkpoint layout): token embedding over the
whole vocabulary; per layer pre-norm RMSNorm (fp32), attention whose q and k pass a per-head
LayerNorm WITH bias over head_dim (eps 1e-5) before a 1-D rotate-half RoPE over the flat
sequence, SwiGLU MLP; final RMSNorm; untied lm_head. `swin_norm` (34B) moves the norms after
attention / MLP. The qk-norm weights are [g, head_dim] with g | heads: HF / Anole store
g = heads, Lumina g = 1 (one row shared by every head, expanded with repeat_interleave).

Only the image-code rows of lm_head are kept (ids first_id .. first_id + num_codes - 1): the
engine never samples another id, and the 7B head shrinks from 65536 to 8192 rows.

`forward` (layers.py's LlamaTarget, shared with Janus) mirrors LlamaGenGPT's: positions, bool mask (R, 1, S, K) and KVCache are arguments.
Checkpoints: DIR/config.json + DIR/model.safetensors or DIR/model.safetensors.index.json with
shards, key names as transformers writes them (model.embed_tokens, model.layers.N.self_attn.
{q,k,v,o}_proj / {q,k}_norm.{weight,bias}, model.layers.N.mlp.{gate,up,down}_proj, model.layers.N.
{input,post_attention}_layernorm, model.norm, lm_head). The VQ encoder under model.vqmodel.* is
not needed for generation and is skipped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from adt_core.families.contract import ImageVocab
from adt_core.families.layers import Attention, DecoderLayer, LlamaBody, LlamaTarget
from adt_core.families.weights import SAFETENSORS_FILES, CheckpointError, WeightFiles, check_state, llama_fields

QK_NORM_EPS = 1e-5  # fixed in Chameleon's qk LayerNorm, whatever rms_norm_eps says
SKIPPED_PREFIXES = ("model.vqmodel.",)  # the image encoder: not used to generate
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # RoPE tables some exports keep


@dataclass(frozen=True)
class ChameleonConfig:
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    vocab_size: int = 65536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    swin_norm: bool = False  # 34B: norms after attention / MLP instead of before
    qk_norm_groups: int = 32  # g in the [g, head_dim] qk-norm weights (HF/Anole: heads; Lumina: 1)
    first_image_id: int = 4  # image code c is id first_image_id + c
    num_image_codes: int = 8192

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        for heads, groups in ((self.num_attention_heads, self.qk_norm_groups),
                              (self.num_key_value_heads, self.k_norm_groups)):
            if groups < 1 or heads % groups:
                raise ValueError(f"qk-norm groups {groups} do not divide {heads} heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def k_norm_groups(self) -> int:
        """k_norm rows: one per kv head when q_norm has one per head, else the shared groups."""
        return self.num_key_value_heads if self.qk_norm_groups == self.num_attention_heads else self.qk_norm_groups

    @property
    def kv_width(self) -> int:
        """Keys (or values) per token per layer: kv_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def vocab(self) -> ImageVocab:
        return ImageVocab(self.first_image_id, self.num_image_codes, self.vocab_size)

    def num_params(self) -> int:
        """Parameters as held here (lm_head: image rows only)."""
        h, hd, g = self.hidden_size, self.head_dim, self.qk_norm_groups
        attn = 2 * h * h + 2 * h * self.kv_width + 2 * (g + self.k_norm_groups) * hd
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + self.num_image_codes * h

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def chameleon_7b(cls, **kw) -> "ChameleonConfig":
        """Chameleon-7B shapes (Anole-7B; Lumina-mGPT-7B with qk_norm_groups=1)."""
        return cls(**kw)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], qk_norm_groups: int | None = None,
                source: str = "config.json", **kw) -> "ChameleonConfig":
        """From a transformers config.json (v4 `rope_theta` or v5 `rope_parameters`)."""
        lm = llama_fields(config, source, eps=1e-5)
        try:
            return cls(**lm, swin_norm=bool(config.get("swin_norm", False)),
                       qk_norm_groups=qk_norm_groups or lm["num_attention_heads"], **kw)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None


# ---- modules ------------------------------------------------------------------------------
class QKNorm(nn.Module):
    """LayerNorm over head_dim per head, with a [g, head_dim] weight and bias shared by groups
    of heads // g consecutive heads (g = heads: one per head)."""

    def __init__(self, groups: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.repeat = heads // groups
        self.weight = nn.Parameter(torch.ones(groups, head_dim))
        self.bias = nn.Parameter(torch.zeros(groups, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, S, heads, hd) -> same shape."""
        w = self.weight.repeat_interleave(self.repeat, dim=0)  # (heads, hd)
        b = self.bias.repeat_interleave(self.repeat, dim=0)
        return F.layer_norm(x, (x.shape[-1],), eps=QK_NORM_EPS) * w + b


def decoder_layer(cfg: ChameleonConfig) -> DecoderLayer:
    """Chameleon's layer: the Llama layer with qk LayerNorm and, for 34B, swin norms."""
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qk_norm = (QKNorm(cfg.qk_norm_groups, heads, hd), QKNorm(cfg.k_norm_groups, kv, hd))
    attn = Attention(cfg.hidden_size, heads, kv, qk_norm=qk_norm)
    return DecoderLayer(attn, cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, swin=cfg.swin_norm)


class ChameleonTarget(LlamaTarget):
    def __init__(self, cfg: ChameleonConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vocab = cfg.vocab
        self.model = LlamaBody(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, lambda: decoder_layer(cfg),
                               cfg.num_hidden_layers)  # `model.*` of the HF checkpoint
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.num_image_codes, bias=False)  # image-code rows only

    @property
    def body(self) -> LlamaBody:
        return self.model

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, S, D) -> logits over image codes (R, S, V) fp32."""
        return self.lm_head(hidden).float()


# ---- checkpoints --------------------------------------------------------------------------
def _skipped(key: str) -> bool:
    return key.startswith(SKIPPED_PREFIXES) or key.endswith(SKIPPED_SUFFIXES)


def _meta(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


def expected_shapes(cfg: ChameleonConfig) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of a Chameleon checkpoint for this config (lm_head over the whole vocabulary)."""
    with torch.device("meta"):
        m = ChameleonTarget(cfg)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def qk_norm_groups(shapes: Mapping[str, tuple[int, ...]], source: str) -> int | None:
    """g of the [g, head_dim] qk-norm weights, read from layer 0 (None when absent: the
    strict check names it)."""
    s = shapes.get("model.layers.0.self_attn.q_norm.weight")
    if s is None:
        return None
    if len(s) != 2:
        raise CheckpointError(f"{source}: model.layers.0.self_attn.q_norm.weight {s} (expected [groups, head_dim])")
    return int(s[0])


def load_chameleon(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   first_image_id: int = 4, num_image_codes: int = 8192) -> ChameleonTarget:
    """A Chameleon target from an HF-layout directory (config.json + safetensors, sharded or not).

    Strict: a missing shard, a missing key, a misshapen tensor or an unknown key raises
    CheckpointError naming it (the image encoder under model.vqmodel.* is skipped). On
    device "meta" only the headers are read: the checks run, the model holds no weights."""
    d = Path(path)
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{d}: no config.json")
    config = json.loads(cfg_file.read_text())
    weights = WeightFiles(d, SAFETENSORS_FILES)
    files = [k for k in weights.files if not _skipped(k)]
    shapes = weights.shapes(files)
    cfg = ChameleonConfig.from_hf(config, qk_norm_groups(shapes, str(d)), str(cfg_file),
                                  first_image_id=first_image_id, num_image_codes=num_image_codes)
    if cfg.first_image_id + cfg.num_image_codes > cfg.vocab_size:
        raise CheckpointError(f"{cfg_file}: image ids end at {cfg.first_image_id + cfg.num_image_codes}, "
                              f"past the vocabulary of {cfg.vocab_size}")
    check_state(_meta(shapes), expected_shapes(cfg), str(d))
    if torch.device(device).type == "meta":  # shapes checked from the headers; no tensor read
        with torch.device("meta"):
            return ChameleonTarget(cfg).to(dtype).eval()
    state = weights.read(files, dtype, device)
    state["lm_head.weight"] = state["lm_head.weight"][cfg.vocab.id_slice].clone()
    with torch.device("meta"):
        model = ChameleonTarget(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()
