"""A model family defined entirely inside tests/: the proof that a family is one folder and one
registry line (tests/adt_core/test_every_family.py registers it; no production file names it).

Built from the shared layers (adt_core/families/layers.py) and the contract
(adt_core/families/contract.py):

    ToyTarget    a one-block decoder over text ids and image codes (codes at ids FIRST ..),
                 1-D rotate-half RoPE, logits over the codes only
    ToyDrafter   an EAGLE-style head: fc([embed(token); target hidden]) -> one block -> features
    ToyDecoder   codes (B, H, W) -> uint8 (B, 2H, 2W, 3) from a fixed palette
    ToyPrompter  token rows: BOS + one id per prompt character (cond), BOS alone (uncond)

On disk a part is a folder holding config.json and model.pt (a state dict); the bundle is a
family bundle directory (adt_core/bundles/family_bundle.py) whose bundle.json names "toy".
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adt_core.bundles.family_bundle import write_family_bundle
from adt_core.config import SamplingConfig
from adt_core.families.contract import ImageVocab, Layout, PromptRows, token_rows
from adt_core.families.layers import MLP, RMSNorm, apply_rotate_half, rope_cos_sin
from adt_core.families.registry import Family
from adt_core.kv_cache import KVCache

NAME = "toy"
BOS, FIRST, CODES, TEXT = 0, 2, 16, 8  # ids: BOS 0, codes 2 .. 17, text 18 .. 25


@dataclass(frozen=True)
class ToyConfig:
    grid_h: int = 3
    grid_w: int = 4
    dim: int = 32
    heads: int = 2
    hidden: int = 64
    max_prompt: int = 8

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def vocab(self) -> ImageVocab:
        return ImageVocab(FIRST, CODES, FIRST + CODES + TEXT)


class Block(nn.Module):
    """Pre-norm attention (fused qkv, RoPE, the KV cache's layer `layer`) + SwiGLU."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1, self.norm2 = RMSNorm(cfg.dim, 1e-5), RMSNorm(cfg.dim, 1e-5)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp = MLP(cfg.dim, cfg.hidden)

    def forward(self, x, positions, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        r, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(r, s, 3, self.cfg.heads, self.cfg.head_dim).unbind(2)  # (R, S, h, hd)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, 10000.0)
        q, k, v = apply_rotate_half(q, cos, sin).transpose(1, 2), apply_rotate_half(k, cos, sin).transpose(1, 2), \
            v.transpose(1, 2)  # (R, h, S, hd)
        if cache is not None:
            k, v = cache.write(layer, k, v)  # (R, h, K, hd)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # mask (R, 1, S, K)
        x = x + self.out(a.transpose(1, 2).reshape(r, s, -1))
        return x + self.mlp(self.norm2(x))


def _rows(positions: torch.Tensor, rows: int) -> torch.Tensor:
    return positions[None].expand(rows, -1) if positions.dim() == 1 else positions


class ToyTarget(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg, self.vocab = cfg, cfg.vocab
        self.embed = nn.Embedding(self.vocab.vocab_size, cfg.dim)
        self.block = Block(cfg)
        self.norm = RMSNorm(cfg.dim, 1e-5)
        self.lm_head = nn.Linear(cfg.dim, CODES, bias=False)

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = self.embed.weight
        return KVCache(1, rows, self.cfg.heads, self.cfg.head_dim, max_len, device or p.device, dtype or p.dtype)

    def forward(self, positions, mask, cache=None, tokens=None, embeds=None):
        x = self.embed(tokens) if tokens is not None else embeds
        x = self.block(x, _rows(positions, x.shape[0]), mask, cache, 0)
        if cache is not None:
            cache.advance(x.shape[1])
        hidden = self.norm(x)
        return self.head(hidden), hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class ToyDrafter(nn.Module):
    """EAGLE's head: features from (token at t, the target's hidden state at t - 1)."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab.vocab_size, cfg.dim)
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg)

    def new_cache(self, rows: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = self.fc.weight
        return KVCache(1, rows, self.cfg.heads, self.cfg.head_dim, max_len, device or p.device, dtype or p.dtype)

    def forward(self, tokens, hidden, positions, mask, cache=None):
        x = self.fc(torch.cat([self.embed(tokens), hidden.to(self.fc.weight.dtype)], -1))
        x = self.block(x, _rows(positions, x.shape[0]), mask, cache, 0)
        if cache is not None:
            cache.advance(x.shape[1])
        return x


class ToyDecoder(nn.Module):
    downsample_factor = 2

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("palette", (torch.arange(CODES * 3).view(CODES, 3) * 37 % 256).to(torch.uint8))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        f = self.downsample_factor
        return self.palette[codes].repeat_interleave(f, 1).repeat_interleave(f, 2)  # (B, H f, W f, 3)


class ToyPrompter:
    def __init__(self, cfg: ToyConfig) -> None:
        self.layout = Layout(cfg.grid_h, cfg.grid_w)
        self.vocab = cfg.vocab
        self.max_prompt = cfg.max_prompt
        self.typical_prompt = cfg.max_prompt // 2

    def rows(self, prompts, cfg: bool) -> PromptRows:
        text = FIRST + CODES
        cond = [[BOS] + [text + ord(ch) % TEXT for ch in p[: self.max_prompt - 1]] for p in prompts]
        return token_rows(cond + ([[BOS]] * len(prompts) if cfg else []), len(prompts))


# ---- on disk ------------------------------------------------------------------------------
def _save(module: nn.Module, cfg: ToyConfig, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(asdict(cfg)))
    torch.save(module.state_dict(), path / "model.pt")


def _config(path) -> ToyConfig:
    return ToyConfig(**json.loads((Path(path) / "config.json").read_text()))


def _load(module: nn.Module, path, dtype, device) -> nn.Module:
    if str(device) != "meta":  # meta: the driver's check, shapes only
        module.load_state_dict(torch.load(Path(path) / "model.pt", weights_only=True))
    return module.to(device=device, dtype=dtype).eval()


def load_target(path, dtype=torch.float32, device="cpu") -> ToyTarget:
    with torch.device("meta" if str(device) == "meta" else "cpu"):
        model = ToyTarget(_config(path))
    return _load(model, path, dtype, device)


def load_drafter(path, target, dtype=torch.float32, device="cpu") -> ToyDrafter:
    with torch.device("meta" if str(device) == "meta" else "cpu"):
        model = ToyDrafter(_config(path))
    return _load(model, path, dtype, device)


def load_decoder(path, device="cpu") -> ToyDecoder:
    return ToyDecoder().to("cpu" if str(device) == "meta" else device)


def load_prompter(path, **options) -> ToyPrompter:
    return ToyPrompter(_config(path))


FAMILY = Family(NAME, load_target, load_drafter, load_decoder, load_prompter)


def save_toy_bundle(root: Path, seed: int = 0, cfg: ToyConfig = ToyConfig()) -> Path:
    """A toy bundle directory: target, drafter and decoder folders, bundle.json naming "toy"."""
    torch.manual_seed(seed)
    target, drafter = ToyTarget(cfg), ToyDrafter(cfg)
    with torch.no_grad():  # peaked logits, as a trained model's (ties between codes are then rare)
        target.lm_head.weight.mul_(8.0)
        drafter.embed.weight.copy_(target.embed.weight)  # a drafter that often agrees with its target
    _save(target, cfg, root / "target")
    _save(drafter, cfg, root / "drafter")
    _save(ToyDecoder(), cfg, root / "vq")
    comps = {"target": "target", "drafter": "drafter", "vq": "vq"}
    return write_family_bundle(root, "tiny-toy", NAME, comps, {},
                               SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=3.0))


def ship_by_value() -> None:
    """Ray's actors cannot import this file (tests/ is not on their path): ship it by value."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def toy_worker() -> type:
    """The job's actor class that registers the toy family in its own process first (an actor
    is a fresh process: the test's registration does not reach it)."""
    from adt_core.families.registry import register
    from pipeline.worker import GeneratorWorker

    class ToyWorker(GeneratorWorker):
        def __init__(self, *args, **kwargs) -> None:
            register(NAME, FAMILY)
            super().__init__(*args, **kwargs)

    return ToyWorker
