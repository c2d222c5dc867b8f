"""Meta's Chameleon VQGAN (taming-transformers layout): codes <-> images.

Chameleon-7B's image tokenizer: 8192 x 256 codebook (plain L2 nearest code, no normalisation),
z 256, ch 128, ch_mult [1, 1, 2, 2, 4] (16x), 2 res blocks per level (the decoder 3), no
attention at any level (attn_resolutions []), attention only in the mid block unless the yaml
says attn_type "none". Files: vqgan.yaml ({"model": {"params": {"embed_dim", "n_embed",
"ddconfig": {...}}}}) and vqgan.ckpt ({"state_dict": ...}, read with weights_only=True), or the
same state dict as vqgan.safetensors. Key names (strict):

    encoder.conv_in, encoder.down.{i}.block.{j}.{norm1,conv1,norm2,conv2[,nin_shortcut]},
    encoder.down.{i}.attn.{j}.*, encoder.down.{i}.downsample.conv, encoder.mid.{block_1,attn_1,block_2},
    encoder.norm_out, encoder.conv_out, quant_conv, quantize.embedding, post_quant_conv,
    decoder.conv_in, decoder.mid.*, decoder.up.{i}.block.{j}.*, decoder.up.{i}.upsample.conv,
    decoder.norm_out, decoder.conv_out          (up.{0} is the FULL-resolution level)

Training-only entries under "loss." (discriminator, perceptual net) are skipped. The res,
attention and resampling blocks are LlamaGen VQ's (adt_core/families/vqgan.py; same math, same
parameter names); only the containers differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from adt_core.families.vqgan import GROUPS, NORM_EPS, AttnBlock, Downsample, ResnetBlock, Upsample, run_blocks
from adt_core.families.weights import CheckpointError, check_state, torch_load

SKIPPED_PREFIXES = ("loss.",)
SEARCH = ("", "tokenizer")  # where vqgan.yaml / vqgan.ckpt sit under a checkpoint directory


@dataclass(frozen=True)
class VQGANConfig:
    n_embed: int = 8192  # codebook size
    embed_dim: int = 256  # code vector width
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)  # f = 2 ** (levels - 1)
    num_res_blocks: int = 2  # per encoder level; the decoder uses one more
    attn_resolutions: tuple[int, ...] = ()  # feature-map sides with attention after each res block
    resolution: int = 512  # training image side: places attn_resolutions
    attn_type: str = "vanilla"  # mid-block attention: "vanilla" or "none"
    in_channels: int = 3
    out_ch: int = 3
    double_z: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ch_mult", tuple(int(m) for m in self.ch_mult))
        object.__setattr__(self, "attn_resolutions", tuple(int(r) for r in self.attn_resolutions))
        if self.attn_type not in ("vanilla", "none"):
            raise ValueError(f"attn_type {self.attn_type!r} (vanilla or none)")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_yaml(cls, spec: Mapping[str, Any], source: str = "vqgan.yaml") -> "VQGANConfig":
        """From the parsed vqgan.yaml (taming's model.params with a ddconfig)."""
        try:
            params = spec["model"]["params"]
            dd = params["ddconfig"]
            kw = dict(n_embed=params["n_embed"], embed_dim=params["embed_dim"], z_channels=dd["z_channels"],
                      ch=dd["ch"], ch_mult=dd["ch_mult"], num_res_blocks=dd["num_res_blocks"],
                      attn_resolutions=dd.get("attn_resolutions") or (), resolution=dd["resolution"],
                      attn_type=dd.get("attn_type", "vanilla"), in_channels=dd.get("in_channels", 3),
                      out_ch=dd.get("out_ch", 3), double_z=bool(dd.get("double_z", False)))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{source}: missing field {e}") from None
        try:
            return cls(**kw)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None

    def decode_bytes(self, height_px: int, width_px: int, live_maps: int = 4) -> int:
        """Estimate of the fp32 activations live while decoding one image: a few feature maps
        of the full-resolution level (ch * ch_mult[0] wide); ~1.2 GB at 768 x 768."""
        return live_maps * self.ch * self.ch_mult[0] * height_px * width_px * 4

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels, eps=NORM_EPS, affine=True)


def _mid(channels: int, cfg: VQGANConfig) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(channels, channels)
    mid.attn_1 = AttnBlock(channels) if cfg.attn_type == "vanilla" else nn.Identity()
    mid.block_2 = ResnetBlock(channels, channels)
    return mid


def _run_mid(mid: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(h)))


def _level(cin: int, cout: int, n_res: int, attn: bool) -> nn.Module:
    level = nn.Module()
    level.block = nn.ModuleList(ResnetBlock(cin if j == 0 else cout, cout) for j in range(n_res))
    level.attn = nn.ModuleList(AttnBlock(cout) for _ in range(n_res if attn else 0))
    return level


def _run_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return run_blocks(level.block, level.attn, h)  # Meta's names: block, attn


class Encoder(nn.Module):
    def __init__(self, cfg: VQGANConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        self.down = nn.ModuleList()
        cin, side = cfg.ch, cfg.resolution
        for i, cout in enumerate(widths):
            level = _level(cin, cout, cfg.num_res_blocks, side in cfg.attn_resolutions)
            if i != len(widths) - 1:
                level.downsample = Downsample(cout)
                side //= 2
            self.down.append(level)
            cin = cout
        self.mid = _mid(cin, cfg)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, 2 * cfg.z_channels if cfg.double_z else cfg.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)  # (B, ch, H, W)
        for level in self.down:
            h = _run_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)  # (B, C_i, H / 2^(i+1), W / 2^(i+1))
        h = _run_mid(self.mid, h)
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, z, H/f, W/f)


class Decoder(nn.Module):
    def __init__(self, cfg: VQGANConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        cin = widths[-1]
        side = cfg.resolution // cfg.downsample_factor
        self.conv_in = nn.Conv2d(cfg.z_channels, cin, 3, padding=1)
        self.mid = _mid(cin, cfg)
        levels: list[nn.Module] = []
        for i in reversed(range(len(widths))):
            level = _level(cin, widths[i], cfg.num_res_blocks + 1, side in cfg.attn_resolutions)
            if i != 0:
                level.upsample = Upsample(widths[i])
                side *= 2
            levels.insert(0, level)  # up[0] = full resolution, as in the checkpoint
            cin = widths[i]
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, cfg.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = _run_mid(self.mid, self.conv_in(z))  # (B, C_last, h, w)
        for level in reversed(self.up):  # lowest resolution first
            h = _run_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)  # spatial x2
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, 3, h*f, w*f)


class Quantizer(nn.Module):
    def __init__(self, cfg: VQGANConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(cfg.n_embed, cfg.embed_dim)

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, e, h, w) -> codes (B, h, w) long: the L2-nearest codebook vector."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])  # (N, e)
        book = self.embedding.weight  # (V, e)
        d = flat.pow(2).sum(1, keepdim=True) + book.pow(2).sum(1) - 2 * flat @ book.t()  # (N, V)
        return d.argmin(1).view(z.shape[0], z.shape[2], z.shape[3])

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> (B, e, h, w)."""
        return self.embedding(codes).permute(0, 3, 1, 2).contiguous()


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) in about [-1, 1] -> uint8 (B, H, W, 3), Meta's conversion (truncating)."""
    x = (x.float().clamp(-1.0, 1.0) + 1.0) / 2.0 * 255.0
    return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class ChameleonVQ(nn.Module):
    def __init__(self, cfg: VQGANConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = Quantizer(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)

    @property
    def downsample_factor(self) -> int:
        return self.cfg.downsample_factor

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """float (B, 3, H, W) in [-1, 1] (or uint8 (B, H, W, 3)) -> codes (B, H/f, W/f)."""
        if images.dtype == torch.uint8:
            images = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        x = images.to(self.quant_conv.weight.dtype)
        f = self.downsample_factor
        if x.shape[-1] % f or x.shape[-2] % f:
            raise ValueError(f"image size {tuple(x.shape[-2:])} is not a multiple of {f}")
        return self.quantize.nearest(self.quant_conv(self.encoder(x)))

    def decode_float(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> float images (B, 3, h*f, w*f), about [-1, 1]."""
        return self.decoder(self.post_quant_conv(self.quantize.lookup(codes.long())))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, h, w) -> uint8 images (B, h*f, w*f, 3)."""
        return to_uint8(self.decode_float(codes))


# ---- files --------------------------------------------------------------------------------
def _find(base: Path, names: tuple[str, ...]) -> Path | None:
    for sub in SEARCH:
        for n in names:
            if (base / sub / n).is_file():
                return base / sub / n
    return None


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        obj: Any = load_file(str(path))
    else:
        try:
            obj = torch_load(path)
        except Exception as e:  # an unpickling refusal: weights_only never runs foreign code
            raise CheckpointError(
                f"{path}: cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {e}). "
                "Convert it once to vqgan.safetensors beside it, only if you trust its source (weights_only=False "
                "runs whatever code the file holds): python -c \"import torch; "
                "from safetensors.torch import save_file; save_file(torch.load('vqgan.ckpt', weights_only=False)"
                "['state_dict'], 'vqgan.safetensors')\"") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a state dict (or {{'state_dict': ...}}) of tensors")
    return {str(k): v for k, v in obj.items() if not str(k).startswith(SKIPPED_PREFIXES)}


def load_chameleon_vq(path: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> ChameleonVQ:
    """Meta's VQGAN from a directory (or its tokenizer/ folder) with vqgan.yaml and
    vqgan.safetensors or vqgan.ckpt, or from the weights file itself with vqgan.yaml beside it.
    Strict: a missing, misshapen or unknown key raises CheckpointError naming it."""
    import yaml

    p = Path(path)
    base = p if p.is_dir() else p.parent
    cfg_file = _find(base, ("vqgan.yaml",))
    weights = p if p.is_file() else _find(base, ("vqgan.safetensors", "vqgan.ckpt"))
    if cfg_file is None or weights is None:
        raise CheckpointError(f"{p}: needs vqgan.yaml and vqgan.ckpt (or vqgan.safetensors)")
    cfg = VQGANConfig.from_yaml(yaml.safe_load(cfg_file.read_text()), str(cfg_file))
    state = _read_state(weights)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in ChameleonVQ(cfg).state_dict().items()}
    check_state(state, expected, str(weights))
    if torch.device(device).type == "meta":  # checked (the state is memory-mapped); no weights
        with torch.device("meta"):
            return ChameleonVQ(cfg).to(dtype).eval()
    model = ChameleonVQ(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model.to(device=device, dtype=dtype).eval()
