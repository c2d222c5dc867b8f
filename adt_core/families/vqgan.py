"""LlamaGen-style VQ image tokenizer (encoder, L2-normalised codebook, decoder), any size.

The module tree and state-dict names follow FoundationVision/LlamaGen
(tokenizer/tokenizer_image/vq_model.py) so a real VQ-16 checkpoint's "model" dict loads
strictly into `VQModel(VQConfig.vq16())`:

    encoder.conv_in
    encoder.conv_blocks.{i}.res.{j}.{norm1,conv1,norm2,conv2[,nin_shortcut]}
    encoder.conv_blocks.{i}.attn.{j}.{norm,q,k,v,proj_out}      (lowest resolution only)
    encoder.conv_blocks.{i}.downsample.conv                      (all but the last level)
    encoder.mid.{0,2} (res), encoder.mid.1 (attn), encoder.norm_out, encoder.conv_out
    quant_conv, quantize.embedding, quantize.codebook_used (buffer), post_quant_conv
    decoder.conv_in, decoder.mid.{0,1,2}
    decoder.conv_blocks.{k}.res.{j} / .attn.{j} / .upsample.conv  (k = 0 is the LOWEST level)
    decoder.norm_out, decoder.conv_out

Vocabulary used below: f = downsample factor (2 ** (levels - 1)); (h, w) = token grid;
e = codebook_embed_dim; z = z_channels; images are in [-1, 1] as float, or uint8 HWC.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from adt_core.families.weights import CheckpointError, key_list

GROUPS = 32  # GroupNorm groups everywhere (channel counts must be multiples of 32)
NORM_EPS = 1e-6
USAGE_WINDOW = 65536  # LlamaGen's rolling window of recently used codes (a buffer on disk)


@dataclass(frozen=True)
class VQConfig:
    """Architecture of a LlamaGen VQ tokenizer; `vq16()` is the released VQ-16."""

    codebook_size: int = 16384  # number of codes (the AR model's image vocabulary)
    codebook_embed_dim: int = 8  # e: code vector width; small e + L2 norm keeps usage high
    z_channels: int = 256  # encoder output / decoder input width
    ch: int = 128  # base width; level i has ch * ch_mult[i] channels
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)  # one entry per level; f = 2 ** (len - 1)
    num_res_blocks: int = 2  # per encoder level; the decoder uses num_res_blocks + 1
    dropout: float = 0.0  # inside res blocks; LlamaGen trains with 0
    commit_loss_beta: float = 0.25  # weight of ||sg(z_q) - z||^2 in the VQ loss
    entropy_loss_ratio: float = 0.0  # weight of the code-entropy regulariser (0 = off)
    codebook_l2_norm: bool = True  # normalise codes and latents before lookup (cosine)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ch_mult", tuple(int(m) for m in self.ch_mult))
        for m in self.ch_mult:
            if (self.ch * m) % GROUPS:
                raise ValueError(f"ch * ch_mult ({self.ch}*{m}) must be a multiple of {GROUPS}")

    @classmethod
    def vq16(cls) -> "VQConfig":
        """The released LlamaGen VQ-16 (16x downsampling, 16384 x 8 codebook, 71.9M params)."""
        return cls(codebook_size=16384, codebook_embed_dim=8, z_channels=256, ch=128,
                   ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ch_mult"] = list(self.ch_mult)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VQConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown VQConfig fields: {sorted(unknown)}")
        return cls(**d)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels, eps=NORM_EPS, affine=True)


def _conv3(cin: int, cout: int, stride: int = 1, padding: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=padding)


def _conv1(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1)


class ResnetBlock(nn.Module):
    """norm-swish-conv twice, plus a 1x1 `nin_shortcut` when the width changes."""

    def __init__(self, cin: int, cout: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = _norm(cin)
        self.conv1 = _conv3(cin, cout)
        self.norm2 = _norm(cout)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = _conv3(cout, cout)
        if cin != cout:
            self.nin_shortcut = _conv1(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all h*w positions with 1x1-conv projections."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q = _conv1(channels, channels)
        self.k = _conv1(channels, channels)
        self.v = _conv1(channels, channels)
        self.proj_out = _conv1(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        # (B, C, h, w) -> (B, 1, h*w, C): one head of width C; SDPA scales by 1/sqrt(C)
        q, k, v = (p(n).reshape(b, 1, c, h * w).transpose(2, 3) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)  # (B, 1, h*w, C)
        a = a.transpose(2, 3).reshape(b, c, h, w)
        return x + self.proj_out(a)


class Downsample(nn.Module):
    """Halve h and w: zero-pad right/bottom by one, then a stride-2 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _conv3(channels, channels, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Double h and w: nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _conv3(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _mid(channels: int, dropout: float) -> nn.ModuleList:
    return nn.ModuleList([ResnetBlock(channels, channels, dropout), AttnBlock(channels),
                          ResnetBlock(channels, channels, dropout)])


def _level(cin: int, cout: int, n_res: int, with_attn: bool, dropout: float) -> nn.Module:
    """One resolution level: `res` blocks, and as many `attn` blocks when with_attn."""
    level = nn.Module()
    level.res = nn.ModuleList(
        [ResnetBlock(cin if j == 0 else cout, cout, dropout) for j in range(n_res)])
    level.attn = nn.ModuleList([AttnBlock(cout) for _ in range(n_res if with_attn else 0)])
    return level


def run_blocks(blocks: nn.ModuleList, attn: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """One resolution level: each ResnetBlock, followed by its AttnBlock when the level has them."""
    for j, block in enumerate(blocks):
        h = block(h)
        if len(attn):
            h = attn[j](h)
    return h


def _run_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return run_blocks(level.res, level.attn, h)


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig, in_channels: int = 3):
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        last = len(widths) - 1
        self.conv_in = _conv3(in_channels, cfg.ch)
        self.conv_blocks = nn.ModuleList()
        cin = cfg.ch
        for i, cout in enumerate(widths):
            level = _level(cin, cout, cfg.num_res_blocks, i == last, cfg.dropout)
            if i != last:
                level.downsample = Downsample(cout)
            self.conv_blocks.append(level)
            cin = cout
        self.mid = _mid(cin, cfg.dropout)
        self.norm_out = _norm(cin)
        self.conv_out = _conv3(cin, cfg.z_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)  # (B, ch, H, W)
        for level in self.conv_blocks:
            h = _run_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)  # (B, C_i, H / 2^(i+1), W / 2^(i+1))
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, z, h, w)


class Decoder(nn.Module):
    """Mirror of the encoder; conv_blocks[0] is the lowest resolution (widest) level."""

    def __init__(self, cfg: VQConfig, out_channels: int = 3):
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        last = len(widths) - 1
        cin = widths[last]
        self.conv_in = _conv3(cfg.z_channels, cin)
        self.mid = _mid(cin, cfg.dropout)
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(len(widths))):
            level = _level(cin, widths[i], cfg.num_res_blocks + 1, i == last, cfg.dropout)
            if i != 0:
                level.upsample = Upsample(widths[i])
            self.conv_blocks.append(level)
            cin = widths[i]
        self.norm_out = _norm(cin)
        self.conv_out = _conv3(cin, out_channels)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)  # (B, C_last, h, w)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = _run_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)  # spatial x2
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, 3, h*f, w*f)


def _entropy_loss(neg_dist: torch.Tensor, temperature: float = 0.01) -> torch.Tensor:
    """Per-sample entropy minus batch-average entropy of softmax(affinity / T)."""
    logits = neg_dist / temperature  # (N, V)
    probs = logits.softmax(-1)
    sample_entropy = -(probs * logits.log_softmax(-1)).sum(-1).mean()
    avg = probs.mean(0)
    avg_entropy = -(avg * torch.log(avg + 1e-5)).sum()
    return sample_entropy - avg_entropy


class VectorQuantizer(nn.Module):
    """Nearest-code lookup; with l2_norm both codes and latents are unit vectors (cosine)."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / cfg.codebook_size, 1.0 / cfg.codebook_size)
            if cfg.codebook_l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, dim=-1))
        # Rolling window of the last 65536 chosen codes (training only); a float buffer in
        # LlamaGen's checkpoints, kept here so they load strictly.
        self.register_buffer("codebook_used", torch.zeros(USAGE_WINDOW))

    def codebook(self) -> torch.Tensor:
        w = self.embedding.weight  # (V, e)
        return F.normalize(w, dim=-1) if self.cfg.codebook_l2_norm else w

    def _latents(self, z: torch.Tensor) -> torch.Tensor:
        z = z.permute(0, 2, 3, 1)  # (B, e, h, w) -> (B, h, w, e)
        return F.normalize(z, dim=-1) if self.cfg.codebook_l2_norm else z

    def nearest(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z (B, e, h, w) -> (codes (B, h, w) long, neg squared distances (B*h*w, V))."""
        zl = self._latents(z)  # (B, h, w, e)
        flat = zl.reshape(-1, zl.shape[-1])  # (N, e)
        emb = self.codebook()  # (V, e)
        d = flat.pow(2).sum(1, keepdim=True) + emb.pow(2).sum(1) - 2 * flat @ emb.t()  # (N, V)
        return d.argmin(1).view(zl.shape[:-1]), -d

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> code vectors (B, e, h, w)."""
        return self.codebook()[codes].permute(0, 3, 1, 2).contiguous()

    def _record_usage(self, codes: torch.Tensor) -> float:
        flat = codes.reshape(-1)[-USAGE_WINDOW:].to(self.codebook_used.dtype)
        n = flat.numel()
        self.codebook_used.copy_(torch.cat([self.codebook_used[n:], flat]))
        return torch.unique(self.codebook_used).numel() / self.cfg.codebook_size

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """z (B, e, h, w) -> (z_q (B, e, h, w) straight-through, codes (B, h, w), losses)."""
        codes, neg_d = self.nearest(z)
        zl = self._latents(z).permute(0, 3, 1, 2)  # (B, e, h, w), normalised if l2
        zq = self.lookup(codes)
        losses: dict[str, Any] = {}
        if self.training:
            losses["codebook"] = F.mse_loss(zq, zl.detach())
            losses["commit"] = self.cfg.commit_loss_beta * F.mse_loss(zl, zq.detach())
            if self.cfg.entropy_loss_ratio > 0:
                losses["entropy"] = self.cfg.entropy_loss_ratio * _entropy_loss(neg_d)
            with torch.no_grad():
                losses["usage"] = self._record_usage(codes)
        zq = zl + (zq - zl).detach()
        return zq, codes, losses


def _to_model_input(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 (B, H, W, 3) or float (B, 3, H, W) in [-1, 1] -> float (B, 3, H, W)."""
    if images.dtype == torch.uint8:
        images = images.permute(0, 3, 1, 2).to(dtype) / 127.5 - 1.0
    return images.to(dtype)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) roughly in [-1, 1] -> uint8 (B, H, W, 3), LlamaGen's rounding."""
    x = ((x.float().clamp(-1, 1) + 1) / 2) * 255 + 0.5
    return x.clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg)
        self.quant_conv = _conv1(cfg.z_channels, cfg.codebook_embed_dim)
        self.post_quant_conv = _conv1(cfg.codebook_embed_dim, cfg.z_channels)

    @property
    def downsample_factor(self) -> int:
        return self.cfg.downsample_factor

    def _dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    def _check_size(self, x: torch.Tensor) -> None:
        f = self.downsample_factor
        if x.shape[-1] % f or x.shape[-2] % f:
            raise ValueError(f"image size {tuple(x.shape[-2:])} is not a multiple of {f}")

    def encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """float (B, 3, H, W) -> pre-quantisation latents (B, e, H/f, W/f)."""
        self._check_size(x)
        return self.quant_conv(self.encoder(x))

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, H, W, 3) or float (B, 3, H, W) in [-1, 1] -> codes (B, H/f, W/f) long."""
        x = _to_model_input(images, self._dtype())
        codes, _ = self.quantize.nearest(self.encode_latents(x))
        return codes

    def decode_latents(self, zq: torch.Tensor) -> torch.Tensor:
        """code vectors (B, e, h, w) -> float images (B, 3, h*f, w*f)."""
        return self.decoder(self.post_quant_conv(zq))

    def decode_float(self, tokens: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> float images (B, 3, h*f, w*f), roughly in [-1, 1]."""
        return self.decode_latents(self.quantize.lookup(tokens.long()))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> uint8 images (B, h*f, w*f, 3)."""
        return to_uint8(self.decode_float(tokens))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Training pass: float (B, 3, H, W) in [-1, 1] -> (recon (B, 3, H, W), VQ losses).

        The dict holds "codebook" and "commit" (and "entropy" when enabled) loss tensors
        and "usage" (fraction of codes in the rolling window) in training mode.
        """
        zq, _, losses = self.quantize(self.encode_latents(x))
        return self.decode_latents(zq), losses


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_pretrained(model: VQModel, directory, dtype: torch.dtype = torch.float16) -> None:
    """Write DIR/config.json (VQConfig fields) + DIR/model.safetensors (params in `dtype`;
    the integer-valued codebook_used buffer stays fp32 so large codebooks stay exact)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: (v if k.endswith("codebook_used") else v.to(dtype)).contiguous().cpu()
             for k, v in model.state_dict().items()}
    save_file(state, str(d / WEIGHTS_FILE))
    (d / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2))


def from_pretrained(directory, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> VQModel:
    """Load a VQModel written by `save_pretrained` (strict key match), in eval mode."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(directory)
    cfg = VQConfig.from_dict(json.loads((d / CONFIG_FILE).read_text()))
    model = VQModel(cfg)
    model.load_state_dict(load_file(str(d / WEIGHTS_FILE)), strict=True)
    return model.to(device=device, dtype=dtype).eval()


def infer_vq_config(state: Mapping[str, torch.Tensor], source: str = "checkpoint") -> VQConfig:
    """A VQConfig from a LlamaGen VQ state dict's shapes (VQ-16: 16384 x 8, ch 128, [1,1,2,2,4])."""
    need = ["quantize.embedding.weight", "quant_conv.weight", "encoder.conv_in.weight"]
    absent = [k for k in need if k not in state]
    if absent:
        raise CheckpointError(f"{source}: not a LlamaGen VQ state dict, missing keys: {key_list(absent)}")
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
