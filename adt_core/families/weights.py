"""Reading checkpoint files safely and checking them against the module they load into.

Shared by every family's loaders (llamagen/weights.py, llamagen/drafter_weights.py, the Janus
and Chameleon loaders); `WeightFiles` is the one reader of (sharded) checkpoint directories.
Weights are read without running pickled code (safetensors, or `torch.load` with
`weights_only=True`; LlamaGen's training checkpoints carry an `argparse.Namespace` under
"args", which is the one class allowed through). `check_state`
refuses a state dict when a required key is missing, a key has the wrong shape or an unknown
key is present; the error names them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

WRAPPER_KEYS = ("model", "module", "state_dict")  # LlamaGen: ddp, deepspeed, plain
STRIP_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
# Non-weights that some checkpoints carry: RoPE tables and inference KV caches.
IGNORED_KEY = re.compile(r"(^|\.)(freqs_cis|rotary_emb\.inv_freq|kv_cache\.[kv]_cache|[kv]_cache)$")
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
    """One model.safetensors file, or every shard named by a model.safetensors.index.json
    (through `WeightFiles`: a missing shard names itself); dtypes as stored."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    files = WeightFiles(path.parent, (path.name,))
    return files.read(files.files)


def read_weights(path: Path) -> Any:
    """A safetensors file (or index) as a state dict, anything else through `torch_load`."""
    if path.name.endswith(".safetensors") or path.name.endswith(".safetensors.index.json"):
        return read_safetensors(path)
    return torch_load(path)


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


# ---- sharded checkpoint directories -------------------------------------------------------
SAFETENSORS_FILES = ("model.safetensors.index.json", "model.safetensors")
HF_WEIGHT_FILES = SAFETENSORS_FILES + ("pytorch_model.bin.index.json", "pytorch_model.bin")


class WeightFiles:
    """key -> file of a checkpoint directory: the first of `names` present (an *.index.json's
    weight_map, whose shards must all exist, or one file). Safetensors are read by header for
    shapes and tensor by tensor; .bin files through `torch_load` (weights_only, memory-mapped),
    each at most once per instance, and must be flat name -> tensor mappings."""

    def __init__(self, directory: str | Path, names: Sequence[str] = HF_WEIGHT_FILES) -> None:
        self.dir = d = Path(directory)
        found = [d / n for n in names if (d / n).is_file()]
        if not found:
            raise CheckpointError(f"{d}: none of {', '.join(names)}")
        first = found[0]
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}
        if first.name.endswith(".index.json"):
            weight_map = json.loads(first.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{first}: no weight_map")
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    held = sorted(k for k, v in weight_map.items() if v == shard)
                    raise CheckpointError(f"{d}: missing shard {shard} (holds {len(held)} tensors, e.g. {held[0]})")
            self.files = {k: d / v for k, v in weight_map.items()}
        else:
            self.files = {k: first for k in self._keys(first)}

    def _keys(self, path: Path) -> list[str]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        return list(self._load_bin(path))

    def _load_bin(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._bin:
            obj = torch_load(path)
            if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise CheckpointError(f"{path}: expected a flat mapping of names to tensors")
            self._bin[path] = dict(obj)
        return self._bin[path]

    def _by_file(self, keys: Iterable[str]) -> dict[Path, list[str]]:
        out: dict[Path, list[str]] = {}
        for k in keys:
            out.setdefault(self.files[k], []).append(k)
        return out

    def shapes(self, keys: Iterable[str]) -> dict[str, tuple[int, ...]]:
        """Shapes of `keys` (no tensor data read for safetensors)."""
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for path, names in self._by_file(keys).items():
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    present = set(f.keys())
                    for k in names:
                        _held(path, k, present)
                        shapes[k] = tuple(f.get_slice(k).get_shape())
            else:
                state = self._load_bin(path)
                for k in names:
                    _held(path, k, state)
                    shapes[k] = tuple(state[k].shape)
        return shapes

    def read(self, keys: Iterable[str], dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
             ) -> dict[str, torch.Tensor]:
        """The named tensors on `device`, contiguous, floating ones cast to `dtype` (None: as stored)."""
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for path, names in self._by_file(keys).items():
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt", device=str(device)) as f:
                    got = {k: f.get_tensor(k) for k in names}
            else:
                state = self._load_bin(path)
                got = {k: state[k].to(device) for k in names}
            for k, t in got.items():
                out[k] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
        return out


def _held(path: Path, key: str, present) -> None:
    if key not in present:
        raise CheckpointError(f"{path.name}: the index names {key} but the shard does not hold it")


# ---- config.json -------------------------------------------------------------------------
def llama_fields(c: Mapping[str, Any], source: str, eps: float = 1e-6) -> dict:
    """The Llama-shaped fields of a transformers config dict (LlamaConfig, ChameleonConfig, a
    Janus text_config): hidden_size, num_attention_heads, intermediate_size, num_hidden_layers,
    vocab_size, num_key_value_heads, rms_norm_eps (`eps` where absent), rope_theta (v4
    `rope_theta` or v5 `rope_parameters`). Refuses what these models do not compute: a RoPE
    other than the default, attention or MLP biases, an activation other than SiLU, a head_dim
    other than hidden_size / heads."""
    try:
        h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        out = dict(hidden_size=h, num_attention_heads=heads, intermediate_size=int(c["intermediate_size"]),
                   num_hidden_layers=int(c["num_hidden_layers"]), vocab_size=int(c["vocab_size"]))
    except KeyError as e:
        raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise CheckpointError(f"{source}: RoPE type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                              f"(default only)")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise CheckpointError(f"{source}: {flag} true is not supported (no biases there)")
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {c['hidden_act']!r} (expected silu)")
    if c.get("head_dim") not in (None, h // heads):
        raise CheckpointError(f"{source}: head_dim {c['head_dim']} != hidden_size / heads ({h // heads})")
    out.update(num_key_value_heads=int(c.get("num_key_value_heads") or heads),
               rms_norm_eps=float(c.get("rms_norm_eps", eps)),
               rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    return out


# ---- validation --------------------------------------------------------------------------
def key_list(keys: list[str]) -> str:
    """Sorted keys for an error message, the first MAX_NAMED of them."""
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
        parts.append(f"missing keys: {key_list(missing)}")
    if shapes:
        parts.append(f"misshaped keys: {key_list(shapes)}")
    if extra:
        parts.append(f"unexpected keys: {key_list(extra)}")
    raise CheckpointError(f"{source}: " + "; ".join(parts))


def module_shapes(module_factory) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the module `module_factory()` builds (on the meta device: no memory)."""
    with torch.device("meta"):
        m = module_factory()
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def cast_floats(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype`, every tensor contiguous."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
