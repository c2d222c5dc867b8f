"""Loaders for the published checkpoints: LlamaGen GPT, LlamaGen VQ, LANTERN drafters.

Every loader reads weights without running pickled code (safetensors, or `torch.load` with
`weights_only=True`; LlamaGen's training checkpoints carry an `argparse.Namespace` under
"args", which is the one class allowed through). Each checks the state dict against the
module it builds and refuses to load when a required key is missing, a key has the wrong
shape or an unknown key is present; the error names them.

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
    LANTERN drafter           DIR/config.json + DIR/pytorch_model.bin | DIR/model.safetensors, 11 keys.
    project drafter           DIR/config.json (DrafterConfig fields: "dim", "n_head", ...) +
                              DIR/model.safetensors: what jobs.train_drafter exports (OUT/drafter)
                              and bundle directories hold; read by the same entry point.

Where a file has no config, the architecture is inferred from tensor shapes (widths, layers,
vocabulary, caption rows); what shapes cannot tell (heads, grid) comes from LlamaGen's "args",
the known LlamaGen sizes, or the caller.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from adt_core.models.drafter import Drafter, DrafterConfig
from adt_core.models.gpt import GPTConfig, LlamaGenGPT
from adt_core.models.rope import RopeTable
from adt_core.models.vq import VQConfig, VQModel

log = logging.getLogger(__name__)

WRAPPER_KEYS = ("model", "module", "state_dict")  # LlamaGen: ddp, deepspeed, plain
STRIP_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
# Non-weights that some checkpoints carry: RoPE tables and inference KV caches.
IGNORED_KEY = re.compile(r"(^|\.)(freqs_cis|rotary_emb\.inv_freq|kv_cache\.[kv]_cache|[kv]_cache)$")
LLAMAGEN_HEADS = {768: 12, 1024: 16, 1280: 20, 1536: 24, 2048: 32, 2560: 40, 3200: 32, 4096: 32}  # dim -> heads
LLAMAGEN_SIZES = {"GPT-B": 12, "GPT-L": 16, "GPT-XL": 20, "GPT-XXL": 24, "GPT-XXXL": 40,
                  "GPT-1B": 32, "GPT-3B": 32, "GPT-7B": 32}  # args.gpt_model -> heads
LANTERN_GRIDS = {"t2i": 16, "t2i2": 32}  # LANTERN drafter config "input_type" -> grid side
UNCOND_KEY = "cls_embedding.uncond_embedding"
MAX_NAMED = 12  # keys named per category in an error message


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it should load into."""


# ---- reading files -----------------------------------------------------------------------
def torch_load(path: str | Path) -> Any:
    """torch.load with weights_only=True; LlamaGen's argparse.Namespace "args" is allowed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) files cannot be memory-mapped
                raise
            return torch.load(path, map_location="cpu", weights_only=True)


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """One model.safetensors file, or every shard named by a model.safetensors.index.json."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.name.endswith(".index.json"):
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for s in shards:
            state.update(load_file(str(path.parent / s)))
        return state
    return load_file(str(path))


def unwrap_state_dict(obj: Any, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The weights of a training checkpoint: the first of "model" / "module" / "state_dict",
    or the object itself when it already maps names to tensors (FSDP / plain saves).
    Prefixes "module." and "_orig_mod." are stripped; RoPE tables and KV caches dropped."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{source}: expected a dict, got {type(obj).__name__}")
    for key in WRAPPER_KEYS:
        if isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    else:
        if not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(
                f"{source}: no weights found; expected one of {list(WRAPPER_KEYS)} or a plain state dict, "
                f"top-level keys are {sorted(map(str, obj))[:MAX_NAMED]}"
            )
    state = {}
    for k, v in obj.items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"{source}: entry {k!r} is a {type(v).__name__}, not a tensor")
        name = str(k)
        stripped = True
        while stripped:
            stripped = False
            for p in STRIP_PREFIXES:
                if name.startswith(p):
                    name, stripped = name[len(p):], True
        if IGNORED_KEY.search(name):
            continue
        if name in state:
            raise CheckpointError(f"{source}: key {name!r} appears twice after stripping prefixes")
        state[name] = v
    return state


def checkpoint_args(obj: Any) -> argparse.Namespace | None:
    args = obj.get("args") if isinstance(obj, Mapping) else None
    return args if isinstance(args, argparse.Namespace) else None


# ---- validation --------------------------------------------------------------------------
def _names(keys: list[str]) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - MAX_NAMED} more)" if len(keys) > MAX_NAMED else ""
    return ", ".join(keys[:MAX_NAMED]) + more


def check_state(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise CheckpointError naming missing, misshaped and unexpected keys (all at once)."""
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} (expected {tuple(expected[k])})"
              for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k])]
    if not (missing or extra or shapes):
        return
    parts = []
    if missing:
        parts.append(f"missing keys: {_names(missing)}")
    if shapes:
        parts.append(f"misshaped keys: {_names(shapes)}")
    if extra:
        parts.append(f"unexpected keys: {_names(extra)}")
    raise CheckpointError(f"{source}: " + "; ".join(parts))


def _expected_shapes(module_factory) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = module_factory()
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def _cast(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}


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
        raise CheckpointError(f"{source}: not a LlamaGen GPT state dict, missing keys: {_names(absent)}")
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
    check_state(state, _expected_shapes(lambda: LlamaGenGPT(cfg)), source)
    with torch.device("meta"):
        model = LlamaGenGPT(cfg)
    model.load_state_dict(_cast(state, dtype), strict=True, assign=True)
    model.rope = RopeTable(cfg.grid_h, cfg.grid_w, cfg.cls_token_num, cfg.head_dim, cfg.rope_base)
    _no_meta(model, source)
    return model.eval()


def _no_meta(model: nn.Module, source: str) -> None:
    left = [k for k, v in list(model.named_parameters()) + list(model.named_buffers()) if v.is_meta]
    if left:
        raise CheckpointError(f"{source}: tensors left unloaded: {_names(left)}")


def _hf_weights_file(d: Path) -> Path:
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _read_weights(path: Path) -> Any:
    if path.name.endswith(".safetensors") or path.name.endswith(".safetensors.index.json"):
        return read_safetensors(path)
    return torch_load(path)


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
        state = unwrap_state_dict(_read_weights(wfile), str(wfile))
        if not is_hf_layout(state):
            cfg = infer_gpt_config(state, None, grid or _config_grid(config), n_head, str(wfile))
            return build_gpt(cfg, state, dtype, str(wfile))
        cfg = gpt_config_from_hf(config, state, grid, str(path / "config.json"))
        return build_gpt(cfg, hf_to_llamagen(state, cfg, str(wfile)), dtype, str(wfile))
    raw = _read_weights(path)
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
def infer_vq_config(state: Mapping[str, torch.Tensor], source: str = "checkpoint") -> VQConfig:
    """A VQConfig from a LlamaGen VQ state dict's shapes (VQ-16: 16384 x 8, ch 128, [1,1,2,2,4])."""
    need = ["quantize.embedding.weight", "quant_conv.weight", "encoder.conv_in.weight"]
    absent = [k for k in need if k not in state]
    if absent:
        raise CheckpointError(f"{source}: not a LlamaGen VQ state dict, missing keys: {_names(absent)}")
    size, e = state["quantize.embedding.weight"].shape
    ch = state["encoder.conv_in.weight"].shape[0]
    z = state["quant_conv.weight"].shape[1]
    levels = sorted({int(m.group(1)) for k in state if (m := re.match(r"encoder\.conv_blocks\.(\d+)\.", k))})
    mult = []
    for i in levels:
        w = state.get(f"encoder.conv_blocks.{i}.res.0.conv1.weight")
        if w is None:
            raise CheckpointError(f"{source}: missing key encoder.conv_blocks.{i}.res.0.conv1.weight")
        mult.append(int(w.shape[0]) // int(ch))
    n_res = len({int(m.group(1)) for k in state if (m := re.match(r"encoder\.conv_blocks\.0\.res\.(\d+)\.", k))})
    return VQConfig(codebook_size=int(size), codebook_embed_dim=int(e), z_channels=int(z), ch=int(ch),
                    ch_mult=tuple(mult), num_res_blocks=n_res)


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
        raw, source = _read_weights(path), str(path)
    state = unwrap_state_dict(raw, source)
    cfg = config or infer_vq_config(state, source)
    check_state(state, _expected_shapes(lambda: VQModel(cfg)), source)
    model = VQModel(cfg)
    model.load_state_dict(_cast(state, dtype), strict=True)
    return model.eval()


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
    state = unwrap_state_dict(_read_weights(path), str(path))
    cfg = drafter_config_from_lantern(config, target, str(cfg_file))
    if "fc.bias" not in state and config.get("bias") is False:
        state["fc.bias"] = torch.zeros(cfg.dim)  # trained without a bias: same function
    check_state(state, _expected_shapes(lambda: Drafter(cfg)), str(path))
    model = Drafter(cfg)
    model.load_state_dict(_cast(state, dtype), strict=True)
    return model.eval()


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
    state = _read_weights(weights)
    check_state(state, _expected_shapes(lambda: Drafter(cfg)), str(weights))
    model = Drafter(cfg)
    model.load_state_dict(_cast(state, dtype), strict=True)
    return model.eval()
