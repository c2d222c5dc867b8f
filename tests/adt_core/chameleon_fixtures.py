"""Tiny Chameleon-family files in the real on-disk layouts, built offline for tests.

- an HF target directory written by transformers' `ChameleonForConditionalGeneration.save_pretrained`
  (config.json + sharded safetensors + index), every weight random (norms and qk-norm biases too);
  optionally rewritten with Lumina's [1, head_dim] qk-norm;
- a `tokenizers` tokenizer.json with Chameleon's id layout: <s> <pad> </s> <unk> at 0..3, image
  tokens IMGIMG* at 4..8195 (code = id - 4), <eoss> 8196, <racm3:break> 8197, <reservedNNNNN> at
  id NNNNN + 4 (end-of-turn <reserved08706> = 8710, end-of-line <reserved08799> = 8803, size
  tokens <reserved08800 + n> = 8804 + n), then byte-level text tokens;
- Meta's VQGAN files (vqgan.yaml + vqgan.ckpt = {"state_dict": ...}) for a tiny config;
- a LANTERN Chameleon drafter directory (config.json + model.safetensors, 16 tensors);
- LANTERN's neighbour table (top_K_indices.npy, uint16 codes).

The image-id range is the real one (ids 4..8195), so the tiny vocabulary is 9400 ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 9400
BYTES_FROM = 9000  # first byte-level text token id
HIDDEN, LAYERS, HEADS, FFN = 64, 2, 4, 128


def image_token_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def reserved_name(token_id: int) -> str:
    return f"<reserved{token_id - 4:05d}>"


# ---- HF target ----------------------------------------------------------------------------
def hf_config(**kw):
    from transformers import ChameleonConfig

    args = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4096,
                vq_config=dict(embed_dim=8, num_embeddings=16, latent_channels=8, resolution=32, base_channels=32,
                               channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[]),
                vocabulary_map={"<image>": 8711}, attn_implementation="eager")
    args.update(kw)
    return args


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


def shared_qk_norm(model, groups: int = 1) -> None:
    """Make every head of a group share its qk-norm row (what a [groups, hd] checkpoint means)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                for p in (norm.weight, norm.bias):
                    rows = p.shape[0] // groups
                    p.copy_(p[::rows].repeat_interleave(rows, dim=0))


def make_hf_chameleon(directory: str | Path, seed: int = 0, qk_groups: int | None = None,
                      shard_size: str = "400KB", **config):
    """Save a tiny random ChameleonForConditionalGeneration to `directory`; return it (eval, fp32).

    qk_groups: rewrite the saved qk-norm tensors as [qk_groups, head_dim] (Lumina: 1)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    torch.manual_seed(seed)
    model = ChameleonForConditionalGeneration(ChameleonConfig(**hf_config(**config))).eval()
    _randomize(model, seed)
    if qk_groups is not None:
        shared_qk_norm(model, qk_groups)
    model.save_pretrained(directory, max_shard_size=shard_size)
    if qk_groups is not None:
        _rewrite_qk_norm(Path(directory), qk_groups)
    return model


def _rewrite_qk_norm(d: Path, groups: int) -> None:
    from safetensors.torch import load_file, save_file

    for shard in sorted(d.glob("model*.safetensors")):
        state = load_file(str(shard))
        changed = False
        for k in list(state):
            if "_norm." in k and "self_attn" in k:
                rows = state[k].shape[0] // groups
                state[k] = state[k][::rows].contiguous()
                changed = True
        if changed:
            save_file(state, str(shard), metadata={"format": "pt"})


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool (R, 1, S, K) -> float additive mask for HF's eager attention."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


# ---- tokenizer ----------------------------------------------------------------------------
def chameleon_vocab() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({image_token_name(c): 4 + c for c in range(8192)})
    vocab.update({"<eoss>": 8196, "<racm3:break>": 8197})
    vocab.update({reserved_name(i): i for i in range(8198, BYTES_FROM)})
    vocab.update({ch: BYTES_FROM + i for i, ch in enumerate(sorted(ByteLevel.alphabet()))})
    return vocab


def make_tokenizer(path: str | Path) -> Path:
    """Write a byte-level BPE tokenizer.json with Chameleon's special-id layout."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = chameleon_vocab()
    merges = [("Ġ", "a"), ("Ġa", "n")]
    n = len(vocab)  # ids are contiguous 0 .. n - 1
    vocab.update({"Ġa": n, "Ġan": n + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<eoss>", "<racm3:break>"]
    specials += [reserved_name(i) for i in range(8198, BYTES_FROM)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


# ---- VQGAN (Meta layout) ------------------------------------------------------------------
def vqgan_yaml(n_embed: int = 32, embed_dim: int = 8, ch: int = 32, ch_mult=(1, 2), z_channels: int = 8,
               num_res_blocks: int = 1, attn_type: str | None = "vanilla", resolution: int = 32) -> dict:
    dd = {"double_z": False, "z_channels": z_channels, "resolution": resolution, "in_channels": 3, "out_ch": 3,
          "ch": ch, "ch_mult": list(ch_mult), "num_res_blocks": num_res_blocks, "attn_resolutions": [],
          "dropout": 0.0}
    if attn_type is not None:
        dd["attn_type"] = attn_type
    return {"model": {"target": "taming.models.vqgan.VQModel",
                      "params": {"embed_dim": embed_dim, "n_embed": n_embed, "ddconfig": dd,
                                 "lossconfig": {"target": "taming.modules.losses.vqperceptual.DummyLoss"}}}}


def make_vqgan(directory: str | Path, seed: int = 0, extra: dict | None = None, drop: str | None = None,
               **yaml_kw) -> Path:
    """Write vqgan.yaml + vqgan.ckpt ({"state_dict": ...}, Meta's key names) for a random tiny VQGAN."""
    import yaml

    from adt_core.families.chameleon.vq import ChameleonVQ, VQGANConfig

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    spec = vqgan_yaml(**yaml_kw)
    (d / "vqgan.yaml").write_text(yaml.safe_dump(spec))
    torch.manual_seed(seed)
    model = ChameleonVQ(VQGANConfig.from_yaml(spec))
    _randomize(model, seed)
    state = dict(model.state_dict())
    state.update(extra or {})
    if drop is not None:
        state.pop(drop)
    torch.save({"state_dict": state, "global_step": 1}, d / "vqgan.ckpt")
    return d


# ---- LANTERN drafter ----------------------------------------------------------------------
def drafter_state(target_dir: str | Path, seed: int = 0, qk_groups: int = HEADS) -> dict[str, torch.Tensor]:
    """16 tensors in LANTERN's names; the embedding is the target's (a frozen copy)."""
    from adt_core.families.weights import SAFETENSORS_FILES, WeightFiles

    g = torch.Generator().manual_seed(seed)
    hd = HIDDEN // HEADS
    rnd = lambda *s: 0.08 * torch.randn(*s, generator=g)  # noqa: E731
    files = WeightFiles(target_dir, SAFETENSORS_FILES)
    state = {"embed_tokens.weight": files.read(["model.embed_tokens.weight"], torch.float32)[
        "model.embed_tokens.weight"], "fc.weight": rnd(HIDDEN, 2 * HIDDEN), "fc.bias": rnd(HIDDEN)}
    for p in ("q", "k", "v", "o"):
        state[f"layers.0.self_attn.{p}_proj.weight"] = rnd(HIDDEN, HIDDEN)
    for p in ("q_norm", "k_norm"):
        state[f"layers.0.self_attn.{p}.weight"] = 1.0 + 3 * rnd(qk_groups, hd)
        state[f"layers.0.self_attn.{p}.bias"] = 3 * rnd(qk_groups, hd)
    state["layers.0.mlp.gate_proj.weight"] = rnd(FFN, HIDDEN)
    state["layers.0.mlp.up_proj.weight"] = rnd(FFN, HIDDEN)
    state["layers.0.mlp.down_proj.weight"] = rnd(HIDDEN, FFN)
    state["layers.0.input_layernorm.weight"] = 1.0 + 3 * rnd(HIDDEN)
    state["layers.0.post_attention_layernorm.weight"] = 1.0 + 3 * rnd(HIDDEN)
    return state


def make_drafter(directory: str | Path, target_dir: str | Path, seed: int = 0, qk_groups: int = HEADS,
                 fmt: str = "safetensors", drop: str | None = None, extra: dict | None = None) -> Path:
    """A LANTERN drafter directory: config.json (the target's, one layer) + weights."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    (d / "config.json").write_text(json.dumps(config))
    state = drafter_state(target_dir, seed, qk_groups)
    state.update(extra or {})
    if drop is not None:
        state.pop(drop)
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    else:
        torch.save(state, d / "pytorch_model.bin")
    return d


def make_neighbours(path: str | Path, num_codes: int, seed: int = 0) -> Path:
    """top_{V-1}_indices.npy: for each code the other codes, nearest first (uint16, as LANTERN saves)."""
    g = torch.Generator().manual_seed(seed)
    book = torch.randn(num_codes, 4, generator=g)
    d = torch.cdist(book, book)
    d.fill_diagonal_(float("inf"))
    table = d.topk(num_codes - 1, dim=1, largest=False).indices
    path = Path(path)
    np.save(path, table.numpy().astype(np.uint16))
    return path
