"""Janus-Pro checkpoint files: layout detection, key names, and the strict
loaders of the target (`load_janus`) and of its VQ-16 decoder (`load_janus_vq`, after a key remap
onto LlamaGen's VQ). The modules they load into are in model.py.

Checkpoints (strict; a missing shard, a missing, misshapen or unknown tensor names itself):
- published (deepseek-ai/Janus-Pro-7B): config.json {"model_type": "multi_modality",
  "language_config", "gen_vision_config", "gen_aligner_config", "gen_head_config", ...} and
  pytorch_model.bin or sharded pytorch_model-*.bin + pytorch_model.bin.index.json (safetensors
  read too; files through adt_core/families/weights.py's WeightFiles). Keys: language_model.model.{embed_tokens, layers.N.self_attn.{q,k,v,o}_proj,
  layers.N.mlp.{gate,up,down}_proj, layers.N.{input,post_attention}_layernorm, norm}, gen_embed,
  gen_aligner.layers.{0,2}, gen_head.{output_mlp_projector, vision_head}. Not read here:
  language_model.lm_head (text), vision_model.* and aligner.* (understanding encoder),
  gen_vision_model.* (the VQ-16: `load_janus_vq`).
- transformers (`JanusForConditionalGeneration.save_pretrained`, deepseek-community/Janus-Pro-*):
  config.json {"model_type": "janus", "text_config", "vq_config"} and safetensors with keys
  model.language_model.*, model.generation_embeddings, model.generation_aligner.{fc1,
  hidden_layers.K}, model.generation_head.{proj_out, vision_head}; model.vqmodel.* is the VQ.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping

import torch

from adt_core.families.janus.model import JanusConfig, JanusTarget, JanusVQ
from adt_core.families.vqgan import USAGE_WINDOW, infer_vq_config
from adt_core.families.weights import CheckpointError, WeightFiles, check_state

PUBLISHED, HF = "published", "transformers"
# prefixes of tensors the target does not read, per layout (text head, understanding path, VQ)
SKIPPED = {PUBLISHED: ("language_model.lm_head.", "vision_model.", "aligner.", "gen_vision_model."),
           HF: ("lm_head.", "model.vision_model.", "model.aligner.", "model.vqmodel.")}
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
VQ_PREFIX = {PUBLISHED: "gen_vision_model.", HF: "model.vqmodel."}


def detect_layout(keys: Iterable[str], source: str) -> str:
    keys = list(keys)
    if any(k.startswith("language_model.model.") for k in keys):
        return PUBLISHED
    if any(k.startswith("model.language_model.") for k in keys):
        return HF
    raise CheckpointError(f"{source}: no language_model.model.* (deepseek-ai/Janus) or model.language_model.* "
                          f"(transformers) tensors - not a Janus checkpoint")


# internal (= published) name <-> transformers name, for the target's tensors
_TO_HF = [(r"^language_model\.model\.", "model.language_model."),
          (r"^gen_embed\.", "model.generation_embeddings."),
          (r"^gen_aligner\.layers\.0\.", "model.generation_aligner.fc1."),
          (r"^gen_head\.output_mlp_projector\.", "model.generation_head.proj_out."),
          (r"^gen_head\.vision_head\.", "model.generation_head.vision_head.")]


def to_hf_name(name: str) -> str:
    m = re.match(r"^gen_aligner\.layers\.(\d+)\.(.*)$", name)
    if m and int(m.group(1)) > 0:
        return f"model.generation_aligner.hidden_layers.{int(m.group(1)) // 2 - 1}.{m.group(2)}"
    for pat, rep in _TO_HF:
        if re.match(pat, name):
            return re.sub(pat, rep, name)
    return name


def expected_shapes(cfg: JanusConfig) -> dict[str, tuple[int, ...]]:
    """Published key -> shape of the tensors the target reads."""
    with torch.device("meta"):
        m = JanusTarget(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def _read_config(d: Path) -> JanusConfig:
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{d}: no config.json")
    return JanusConfig.from_json(json.loads(cfg_file.read_text()), str(cfg_file))


def load_janus(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> JanusTarget:
    """A Janus target from a checkpoint directory in either layout (module docstring).

    Strict: a missing shard, a missing key, a misshapen tensor or an unknown key (outside the
    skipped text head, understanding encoder and VQ) raises CheckpointError naming it, in the
    file's own key names."""
    d = Path(path)
    cfg = _read_config(d)
    weights = WeightFiles(d)
    layout = detect_layout(weights.files, str(d))
    names = {k for k in weights.files
             if not k.startswith(SKIPPED[layout]) and not k.endswith(SKIPPED_SUFFIXES)}
    expected = expected_shapes(cfg)
    if layout == HF:
        expected = {to_hf_name(k): s for k, s in expected.items()}
    shapes = weights.shapes(names)
    check_state({k: torch.empty(s, device="meta") for k, s in shapes.items()}, expected, str(d))
    state = weights.read(sorted(names), dtype, device)
    if layout == HF:
        back = {to_hf_name(k): k for k in expected_shapes(cfg)}
        state = {back[k]: v for k, v in state.items()}
    with torch.device("meta"):
        model = JanusTarget(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


# ---- the VQ-16 decoder's weights ----------------------------------------------------------
def vq_name_from_hf(name: str) -> str:
    """A transformers JanusVQVAE key (model.vqmodel. stripped) -> LlamaGen's VQ key."""
    name = re.sub(r"^(encoder)\.down\.", r"\1.conv_blocks.", name)
    name = re.sub(r"^(decoder)\.up\.", r"\1.conv_blocks.", name)
    name = re.sub(r"^((?:en|de)coder\.conv_blocks\.\d+)\.block\.", r"\1.res.", name)
    return re.sub(r"^((?:en|de)coder\.mid)\.(block_1|attn_1|block_2)\.",
                  lambda m: f"{m.group(1)}.{('block_1', 'attn_1', 'block_2').index(m.group(2))}.", name)


def remap_vq_state(state: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """The VQ tensors of a Janus checkpoint (prefixed keys) -> LlamaGen VQModel's state dict.

    Published: gen_vision_model.<LlamaGen name> (Janus' vq_model.py is LlamaGen's module tree),
    so the remap only strips the prefix. transformers: encoder.down / decoder.up ->
    conv_blocks, block -> res, mid.{block_1, attn_1, block_2} -> mid.{0, 1, 2}. The training-only
    quantize.codebook_used buffer (which transformers drops) is zero-filled when absent."""
    prefix = VQ_PREFIX[layout]
    out = {}
    for k, v in state.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        out[vq_name_from_hf(name) if layout == HF else name] = v
    out.setdefault("quantize.codebook_used", torch.zeros(USAGE_WINDOW))
    return out


def load_janus_vq(path: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> JanusVQ:
    """Janus' VQ-16 from a checkpoint directory (either layout): only the VQ tensors are read,
    remapped onto adt_core.families.vqgan (architecture from the tensor shapes), loaded strictly."""
    d = Path(path)
    weights = WeightFiles(d)
    layout = detect_layout(weights.files, str(d))
    keys = sorted(k for k in weights.files if k.startswith(VQ_PREFIX[layout]))
    if not keys:
        raise CheckpointError(f"{d}: no {VQ_PREFIX[layout]}* tensors (the VQ-16 image decoder)")
    state = remap_vq_state(weights.read(keys, torch.float32), layout)
    cfg = infer_vq_config(state, f"{d} ({VQ_PREFIX[layout]}*)")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in JanusVQ(cfg).state_dict().items()}
    check_state(state, expected, f"{d} ({VQ_PREFIX[layout]}*, as LlamaGen VQ keys)")
    model = JanusVQ(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()
