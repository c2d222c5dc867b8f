"""Tiny Janus files in the real on-disk layouts, built offline for tests.

- a random transformers `JanusForConditionalGeneration` (Llama 64 wide, 2 layers; codebook 64 x 8;
  a 2-level VQ; a 1-layer SigLIP), every weight random (norms and biases too);
- saved as deepseek-ai/Janus publishes it: config.json {"model_type": "multi_modality",
  language_config, gen_vision_config, gen_aligner_config, gen_head_config, vision_config,
  aligner_config} and pytorch_model-0000i-of-0000n.bin shards + pytorch_model.bin.index.json, keys
  language_model.model.*, language_model.lm_head.weight, gen_embed, gen_aligner.layers.{0,2},
  gen_head.{output_mlp_projector,vision_head}, gen_vision_model.* (LlamaGen VQ names, with
  quantize.codebook_used), vision_model.* and aligner.layers.{0,2} (the understanding path:
  present so that skipping it is exercised; its inner names are transformers', not SigLIP's);
- or as transformers saves it (`save_pretrained`: config.json "janus" + safetensors);
- a `tokenizers` tokenizer.json with DeepSeek's special-token names (byte-level BPE; the ids are
  small, the names real: <｜begin▁of▁sentence｜>, <｜▁pad▁｜>, <begin_of_image>, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

TEXT_VOCAB, HIDDEN, LAYERS, HEADS, FFN = 288, 64, 2, 4, 128
CODES, CODE_DIM, GRID = 64, 8, 4  # codebook; 4 x 4 codes (vision image 32 px / patch 8)
SPECIALS = {"<｜begin▁of▁sentence｜>": 260, "<｜end▁of▁sentence｜>": 261, "<｜▁pad▁｜>": 262,
            "<image_placeholder>": 263, "<begin_of_image>": 264, "<end_of_image>": 265}
BOS, PAD, BOI = 260, 262, 264


def hf_config(kv_heads: int = HEADS, **text):
    from transformers import JanusConfig

    t = dict(model_type="llama", vocab_size=TEXT_VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
             max_position_embeddings=512, bos_token_id=BOS, eos_token_id=261, pad_token_id=PAD)
    t.update(text)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
                  projection_dim=HIDDEN, num_image_tokens=GRID * GRID, mlp_ratio=2.0)
    vq = dict(embed_dim=CODE_DIM, num_embeddings=CODES, latent_channels=32, base_channels=32,
              channel_multiplier=[1, 2], num_res_blocks=1, projection_dim=HIDDEN, image_token_embed_dim=HIDDEN,
              num_hidden_layers=2)
    cfg = JanusConfig(text_config=t, vision_config=vision, vq_config=vq, image_token_id=263)
    cfg.text_config._attn_implementation = "eager"
    return cfg


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def make_hf_janus(seed: int = 0, **config):
    """A tiny random JanusForConditionalGeneration (eval, fp32, eager attention)."""
    from transformers import JanusForConditionalGeneration

    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(hf_config(**config)).eval()
    _randomize(model, seed)
    return model


# ---- the published (deepseek-ai/Janus) layout ----------------------------------------------
_VQ_TO_PUBLISHED = [  # transformers JanusVQVAE name -> Janus / LlamaGen vq_model.py name
    (r"^(encoder)\.down\.", r"\1.conv_blocks."), (r"^(decoder)\.up\.", r"\1.conv_blocks."),
    (r"^((?:en|de)coder\.conv_blocks\.\d+)\.block\.", r"\1.res."),
    (r"^((?:en|de)coder\.mid)\.block_1\.", r"\1.0."), (r"^((?:en|de)coder\.mid)\.attn_1\.", r"\1.1."),
    (r"^((?:en|de)coder\.mid)\.block_2\.", r"\1.2."),
]


def published_name(hf_name: str) -> str:
    """A transformers Janus key -> the name deepseek-ai/Janus' checkpoints use (written
    independently of adt_core's reverse map, which the tests hold against it)."""
    n = hf_name
    if n.startswith("model.vqmodel."):
        n = n[len("model.vqmodel."):]
        for pat, rep in _VQ_TO_PUBLISHED:
            n = re.sub(pat, rep, n)
        return "gen_vision_model." + n
    for old, new in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                     ("model.generation_embeddings.", "gen_embed."),
                     ("model.generation_aligner.fc1.", "gen_aligner.layers.0."),
                     ("model.generation_aligner.hidden_layers.0.", "gen_aligner.layers.2."),
                     ("model.generation_head.proj_out.", "gen_head.output_mlp_projector."),
                     ("model.generation_head.vision_head.", "gen_head.vision_head."),
                     ("model.aligner.fc1.", "aligner.layers.0."),
                     ("model.aligner.hidden_layers.0.", "aligner.layers.2."),
                     ("model.vision_model.", "vision_model.vision_tower.")):
        if n.startswith(old):
            return new + n[len(old):]
    raise KeyError(hf_name)


def published_config(model) -> dict:
    """config.json as deepseek-ai/Janus writes it, for a transformers model (or its JanusConfig)."""
    config = getattr(model, "config", model)
    t, vq = config.text_config, config.vq_config
    return {
        "model_type": "multi_modality", "architectures": ["MultiModalityCausalLM"], "torch_dtype": "bfloat16",
        "language_config": {"model_type": "llama", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
                            "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
                            "num_attention_heads": t.num_attention_heads,
                            "num_key_value_heads": t.num_key_value_heads,
                            "max_position_embeddings": t.max_position_embeddings, "torch_dtype": "bfloat16"},
        "gen_vision_config": {"cls": "VQ-16", "model_type": "gen_vision",
                              "params": {"image_token_size": vq.num_embeddings, "n_embed": vq.embed_dim}},
        "gen_aligner_config": {"cls": "MlpProjector", "model_type": "gen_aligner",
                               "params": {"depth": 2, "input_dim": vq.embed_dim, "n_embed": t.hidden_size,
                                          "projector_type": "mlp_gelu"}},
        "gen_head_config": {"cls": "vision_head", "model_type": "gen_head",
                            "params": {"image_token_embed": vq.projection_dim, "image_token_size": vq.num_embeddings,
                                       "n_embed": t.hidden_size}},
        "vision_config": {"cls": "CLIPVisionTower", "model_type": "vision",
                          "params": {"image_size": 32, "model_name": "siglip_large_patch16_384",
                                     "select_feature": "same", "select_layer": -1}},
        "aligner_config": {"cls": "MlpProjector", "model_type": "aligner",
                           "params": {"depth": 2, "input_dim": 32, "n_embed": t.hidden_size,
                                      "projector_type": "mlp_gelu"}},
    }


def published_state(model) -> dict[str, torch.Tensor]:
    state = {published_name(k): v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state["gen_vision_model.quantize.codebook_used"] = torch.zeros(65536)  # VQ-16's usage buffer
    return state


def save_published(model, directory: str | Path, shards: int = 2, fmt: str = "bin",
                   drop: str | None = None, extra: dict | None = None) -> Path:
    """Write `model` as deepseek-ai/Janus-Pro-* is published: config.json + weight shards + index
    (fmt "bin": pytorch_model-*.bin, "safetensors": model-*.safetensors; shards=1: one file, no index)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(published_config(model), indent=2))
    state = published_state(model)
    state.update(extra or {})
    if drop is not None:
        state.pop(drop)
    keys = sorted(state)
    stem, ext = ("pytorch_model", "bin") if fmt == "bin" else ("model", "safetensors")
    if shards == 1:
        _save({k: state[k] for k in keys}, d / f"{stem}.{ext}")
        return d
    weight_map = {}
    for i in range(shards):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.{ext}"
        part = keys[i::shards]
        _save({k: state[k] for k in part}, d / name)
        weight_map.update({k: name for k in part})
    (d / f"{stem}.{ext}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path), metadata={"format": "pt"})
    else:
        torch.save(state, path)


def save_transformers(model, directory: str | Path) -> Path:
    model.save_pretrained(directory, max_shard_size="300KB")
    return Path(directory)


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool (R, 1, S, K) -> float additive mask for HF's eager attention."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


# ---- tokenizer ----------------------------------------------------------------------------
def make_tokenizer(path: str | Path, special_tokens_map: bool = True, omit: tuple[str, ...] = ()) -> Path:
    """A byte-level BPE tokenizer.json with DeepSeek's special-token names (see SPECIALS); a name
    in `omit` is left out (its id holds a filler token instead)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}  # 256 byte tokens
    merges = [("<", "|"), ("Ġ", "a"), ("Ġa", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n = len(vocab)
    for i in range(n, min(SPECIALS.values())):  # filler ids up to the specials
        tok.add_tokens([AddedToken(f"<filler{i}>", special=True, normalized=False)])
    tok.add_special_tokens([AddedToken(s if s not in omit else f"<omitted{i}>", special=True, normalized=False)
                            for s, i in SPECIALS.items()])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    got = tok.get_vocab(with_added_tokens=True)
    assert all(got[s] == i for s, i in SPECIALS.items() if s not in omit), {s: got.get(s) for s in SPECIALS}
    if special_tokens_map:
        names = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                 "pad_token": "<｜▁pad▁｜>"}
        (path.parent / "special_tokens_map.json").write_text(json.dumps(names))
    return path
