"""Janus-Pro target (deepseek-ai/Janus-Pro-7B, -1B) with an explicit forward, and its VQ-16 decoder.

Architecture (deepseek-ai/Janus janus/models/modeling_vlm.py; transformers' models/janus):
the language model is a Llama (DeepSeek-LLM: pre-norm RMSNorm in fp32, 1-D rotate-half RoPE over
the flat sequence, SwiGLU, no biases, no qk-norm, GQA allowed). Image generation uses its own
input and output paths, separate from the text embedding and lm_head:

    input   code c -> gen_embed [V, e] -> gen_aligner: Linear(e, H), GELU, Linear(H, H) -> (H,)
    output  hidden -> gen_head: output_mlp_projector Linear(H, E), GELU, vision_head Linear(E, V)

(7B: H = E = 4096, V = 16384, e = 8, 30 layers, 32 heads; GELU is the exact erf form.)

Ids. Text ids and image codes are different embedding tables, so the contract's one id space
puts codes after the text vocabulary: code c is id T + c (T = the text vocabulary, 102400 for
7B; `ImageVocab(T, V, T + V)`). `embed` sends ids < T through the text embedding and ids
T .. T + V - 1 through gen_embed + gen_aligner; logits cover the V codes only (gen_head).

Reading checkpoint files (either on-disk layout) and the strict loaders `load_janus` /
`load_janus_vq` are in janus/weights.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
from torch import nn

from adt_core.families.contract import ImageVocab
from adt_core.families.layers import Attention, DecoderLayer, LlamaBody, LlamaTarget
from adt_core.families.vqgan import VQModel
from adt_core.families.weights import CheckpointError, llama_fields


@dataclass(frozen=True)
class JanusConfig:
    hidden_size: int = 4096  # H
    intermediate_size: int = 11008
    num_hidden_layers: int = 30
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    vocab_size: int = 102400  # T: text ids (the LM's embed_tokens rows); code c is id T + c
    rms_norm_eps: float = 1e-6  # LlamaConfig's default; Janus' language_config does not set it
    rope_theta: float = 10000.0
    num_image_codes: int = 16384  # V
    code_dim: int = 8  # e: gen_embed width (the VQ codebook's)
    aligner_depth: int = 2  # gen_aligner: Linear(e, H), then (GELU, Linear(H, H)) x (depth - 1)
    head_width: int = 4096  # E: gen_head's inner width (image_token_embed)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.aligner_depth < 1:
            raise ValueError(f"aligner depth {self.aligner_depth} < 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def vocab(self) -> ImageVocab:
        return ImageVocab(self.vocab_size, self.num_image_codes, self.vocab_size + self.num_image_codes)

    def num_params(self) -> int:
        """Parameters held here (no text lm_head, no understanding encoder, no VQ)."""
        h, e, v, w = self.hidden_size, self.code_dim, self.num_image_codes, self.head_width
        layer = 2 * h * h + 2 * h * self.kv_width + 3 * h * self.intermediate_size + 2 * h
        aligner = e * h + h + (self.aligner_depth - 1) * (h * h + h)
        head = h * w + w + w * v + v
        return self.vocab_size * h + self.num_hidden_layers * layer + h + v * e + aligner + head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def janus_pro_7b(cls, **kw) -> "JanusConfig":
        return cls(**kw)

    @classmethod
    def from_json(cls, config: Mapping[str, Any], source: str = "config.json") -> "JanusConfig":
        """From either layout's config.json (published "multi_modality" or transformers "janus")."""
        try:
            if "language_config" in config:
                return cls._from_published(config, source)
            if "text_config" in config:
                return cls._from_transformers(config, source)
        except KeyError as e:
            raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None
        raise CheckpointError(f"{source}: neither language_config (deepseek-ai/Janus) nor text_config "
                              f"(transformers) - not a Janus config")

    @classmethod
    def _from_published(cls, config: Mapping[str, Any], source: str) -> "JanusConfig":
        lm = llama_fields(config["language_config"], f"{source}: language_config")
        vq = config["gen_vision_config"]["params"]
        aligner = config["gen_aligner_config"]["params"]
        head = config["gen_head_config"]["params"]
        if aligner.get("projector_type", "mlp_gelu") != "mlp_gelu":
            raise CheckpointError(f"{source}: gen_aligner projector_type {aligner['projector_type']!r} "
                                  f"(expected mlp_gelu)")
        h = lm["hidden_size"]
        for what, got in (("gen_aligner n_embed", aligner["n_embed"]), ("gen_head n_embed", head["n_embed"])):
            if int(got) != h:
                raise CheckpointError(f"{source}: {what} {got} != the language model's hidden size {h}")
        v = int(vq["image_token_size"])
        if int(head["image_token_size"]) != v or int(aligner["input_dim"]) != int(vq["n_embed"]):
            raise CheckpointError(f"{source}: gen_vision_config, gen_aligner_config and gen_head_config disagree "
                                  f"on the codebook ({v} x {vq['n_embed']})")
        return cls._build(lm, source, num_image_codes=v, code_dim=int(vq["n_embed"]),
                          aligner_depth=int(aligner.get("depth", 1)), head_width=int(head["image_token_embed"]))

    @classmethod
    def _from_transformers(cls, config: Mapping[str, Any], source: str) -> "JanusConfig":
        lm = llama_fields(config["text_config"], f"{source}: text_config")
        vq = config.get("vq_config") or {}
        d = {"embed_dim": 8, "num_embeddings": 16384, "projection_dim": 2048, "num_hidden_layers": 2,
             "image_token_embed_dim": 2048, "hidden_act": "gelu", **vq}  # JanusVQVAEConfig defaults
        if d["hidden_act"] != "gelu":
            raise CheckpointError(f"{source}: vq_config hidden_act {d['hidden_act']!r} (expected gelu)")
        h = lm["hidden_size"]
        for what in ("projection_dim", "image_token_embed_dim"):
            if int(d[what]) != h:
                raise CheckpointError(f"{source}: vq_config {what} {d[what]} != text hidden size {h}")
        return cls._build(lm, source, num_image_codes=int(d["num_embeddings"]), code_dim=int(d["embed_dim"]),
                          aligner_depth=int(d["num_hidden_layers"]), head_width=int(d["projection_dim"]))

    @classmethod
    def _build(cls, lm: dict, source: str, **kw) -> "JanusConfig":
        try:
            return cls(**lm, **kw)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None


# ---- modules ------------------------------------------------------------------------------
def decoder_layer(cfg: JanusConfig, input_norm: bool = True) -> DecoderLayer:
    """The Llama layer: no biases, no qk-norm, GQA; input_norm=False for EAGLE's drafter layer."""
    attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    return DecoderLayer(attn, cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, input_norm=input_norm)


class LanguageModel(nn.Module):
    def __init__(self, cfg: JanusConfig) -> None:
        super().__init__()
        self.model = LlamaBody(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, lambda: decoder_layer(cfg),
                               cfg.num_hidden_layers)  # `language_model.model.*`


class GenAligner(nn.Module):
    """`gen_aligner.layers`: Linear(e, H), then (GELU, Linear(H, H)) per extra depth (keys 0, 2, ...)."""

    def __init__(self, cfg: JanusConfig) -> None:
        super().__init__()
        mods: list[nn.Module] = [nn.Linear(cfg.code_dim, cfg.hidden_size)]
        for _ in range(1, cfg.aligner_depth):
            mods += [nn.GELU(), nn.Linear(cfg.hidden_size, cfg.hidden_size)]
        self.layers = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class GenHead(nn.Module):
    """`gen_head`: output_mlp_projector Linear(H, E), GELU, vision_head Linear(E, V)."""

    def __init__(self, cfg: JanusConfig) -> None:
        super().__init__()
        self.output_mlp_projector = nn.Linear(cfg.hidden_size, cfg.head_width)
        self.vision_activation = nn.GELU()
        self.vision_head = nn.Linear(cfg.head_width, cfg.num_image_codes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vision_head(self.vision_activation(self.output_mlp_projector(x)))


class JanusTarget(LlamaTarget):
    def __init__(self, cfg: JanusConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vocab = cfg.vocab
        self.language_model = LanguageModel(cfg)
        self.gen_embed = nn.Embedding(cfg.num_image_codes, cfg.code_dim)
        self.gen_aligner = GenAligner(cfg)
        self.gen_head = GenHead(cfg)

    @property
    def body(self) -> LlamaBody:
        return self.language_model.model

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Image codes (any shape) -> LM inputs (..., H): gen_aligner(gen_embed(codes)),
        Janus' prepare_gen_img_embeds; the drafter's token embedding too."""
        return self.gen_aligner(self.gen_embed(codes))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Ids (R, S) -> inputs (R, S, H): text ids through embed_tokens, code ids (T + c)
        through the image path. Both are computed for every id (no host sync on the mix)."""
        v = self.vocab
        is_code = v.is_code(tokens)
        text = self.body.embed_tokens(torch.where(is_code, 0, tokens))
        image = self.embed_codes(torch.where(is_code, v.to_code(tokens), 0))
        return torch.where(is_code[..., None], image.to(text.dtype), text)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, S, H) -> logits over image codes (R, S, V) fp32 (gen_head, not the text lm_head)."""
        return self.gen_head(hidden).float()


# ---- the VQ-16 decoder --------------------------------------------------------------------
class JanusVQ(VQModel):
    """LlamaGen's VQ model (the same architecture and parameter names) with Janus' pixel
    conversion: uint8 = trunc(clip((x + 1) / 2 * 255, 0, 255)) (LlamaGen's adds 0.5 first)."""

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> uint8 images (B, h*f, w*f, 3)."""
        x = self.decode_float(tokens).float()
        x = ((x + 1) / 2 * 255).clamp(0, 255)
        return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous()
