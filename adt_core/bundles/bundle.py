"""A bundle: everything needed to turn prompts into images with one target family.

On disk a bundle is a directory:

    bundle.json            name, grid [H, W], sampling defaults, text encoder spec, components
    target/config.json     GPTConfig fields          target/model.safetensors
    drafter/config.json    DrafterConfig fields      drafter/model.safetensors   (optional)
    vq/config.json         VQConfig fields           vq/model.safetensors
    provenance.json        (exported bundles) the training runs and their final metrics
    reference.json         (exported bundles) a stored greedy token grid (jobs/train/reference.py)

`load_bundle_dir("emoji16")` reads the embedded bundle shipped in adt_core/bundles/ (`adt_core.load_bundle`
loads bundle directories and manifests alike).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adt_core.config import SamplingConfig
from adt_core.families.llamagen.drafter import Drafter, DrafterConfig
from adt_core.families.llamagen.model import GPTConfig, LlamaGenGPT
from adt_core.families.llamagen.text_encoder import HashTextEncoder, TextEncoder
from adt_core.families.vqgan import VQConfig, VQModel

EMBEDDED_DIR = Path(__file__).resolve().parent
DEFAULT_BUNDLE = "emoji16"


@dataclass
class Bundle:
    name: str
    text_encoder: TextEncoder
    target: LlamaGenGPT
    drafter: Drafter | None
    vq: VQModel
    grid: tuple[int, int]  # (H, W) image tokens
    sampling: SamplingConfig  # defaults for DecodeConfig fields left None
    family: str = "llamagen"  # the model family (adt_core/families/contract.py)
    prompter: object | None = None  # the family's Prompter; None: LlamaGen's, from text_encoder + target
    neighbours: Path | None = None  # LANTERN's neighbour table (.npy, row = code); None: from the VQ codebook

    def neighbour_table(self, k: int) -> torch.Tensor:
        """(V, k) long: each code's k nearest other codes, nearest first (LANTERN's relaxation):
        the family's shipped table when the bundle names one, else computed from the decoder's
        codebook (cached on disk; adt_core/round/lantern.py)."""
        if self.neighbours is not None:
            from adt_core.round.lantern import load_neighbours

            return load_neighbours(self.neighbours, k, num_codes=self.make_prompter().vocab.num_codes)
        from adt_core.round.lantern import neighbour_table

        return neighbour_table(self.vq.quantize.embedding.weight, k)

    def make_prompter(self):
        """The family's Prompter (prompt rows, layout, image vocabulary). LlamaGen's is built from
        the bundle's text encoder, target and grid, and checks that the two agree."""
        if self.prompter is not None:
            return self.prompter
        from adt_core.families.llamagen.prompt import LlamaGenPrompter

        return LlamaGenPrompter(self.text_encoder, self.target, self.grid)

    def component_bytes(self) -> dict[str, int]:
        """Bytes of parameters and buffers per component, at their current dtype."""
        size = lambda m: sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))  # noqa: E731
        out = {"target": size(self.target), "vq": size(self.vq)}
        if self.drafter is not None:
            out["drafter"] = size(self.drafter)
        if isinstance(self.text_encoder, torch.nn.Module):
            out["text_encoder"] = size(self.text_encoder)
        return out


def build_text_encoder(spec: dict) -> TextEncoder:
    kind = spec.get("type")
    kw = {k: v for k, v in spec.items() if k != "type"}
    if kind == "hash":
        return HashTextEncoder(**kw)
    if kind == "minilm":
        from adt_core.families.llamagen.minilm import MiniLMTextEncoder

        return MiniLMTextEncoder(**kw)
    if kind == "t5":
        from adt_core.families.llamagen.t5 import T5TextEncoder

        return T5TextEncoder(**kw)
    raise ValueError(f"unknown text encoder type {kind!r} (expected 'hash', 'minilm' or 't5')")


def check_text_encoder(spec: dict) -> None:
    """What building this text encoder imports, without loading weights from a remote path."""
    kind = spec.get("type")
    if kind == "minilm":
        from adt_core.families.llamagen.minilm import bundled_model_dir

        if spec.get("model_dir") is None:
            bundled_model_dir()
        import transformers  # noqa: F401
    elif kind == "t5":
        import transformers  # noqa: F401
        from transformers import T5EncoderModel  # noqa: F401


def random_bundle(
    seed: int = 0,
    vocab: int = 64,
    grid: tuple[int, int] = (8, 8),
    dim: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    caption_len: int = 8,
    caption_dim: int = 32,
    sampling: SamplingConfig | None = None,
    drafter: bool = True,
) -> Bundle:
    """A tiny random-init bundle for tests: nothing is trained, everything is real code."""
    torch.manual_seed(seed)
    h, w = grid
    tcfg = GPTConfig(
        dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=vocab, cls_token_num=caption_len,
        caption_dim=caption_dim, grid_h=h, grid_w=w, multiple_of=32,
    )
    target = LlamaGenGPT(tcfg)
    # Random init gives near-uniform logits; scale the head so distributions are peaked, as a
    # trained model's are (ties between near-equal logits are then rare, as in real models).
    with torch.no_grad():
        target.output.weight.mul_(8.0)
    draft = Drafter(DrafterConfig.for_target(tcfg)) if drafter else None
    vq = VQModel(VQConfig(codebook_size=vocab, codebook_embed_dim=4, z_channels=8, ch=32, ch_mult=(1, 1), num_res_blocks=1))
    text = HashTextEncoder(dim=caption_dim, max_tokens=caption_len, seed=seed)
    for m in (target, draft, vq):
        if m is not None:
            m.eval()
    return Bundle(
        name=f"random-{seed}", text_encoder=text, target=target, drafter=draft, vq=vq, grid=(h, w),
        sampling=sampling or SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=2.0),
    )


def _config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _save_component(module: torch.nn.Module, cfg, path: Path, dtype: torch.dtype) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config_dict(cfg), indent=2))
    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))


def save_bundle(bundle: Bundle, path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = bundle.text_encoder.config() if hasattr(bundle.text_encoder, "config") else {"type": "minilm"}
    meta = {
        "name": bundle.name,
        "grid": list(bundle.grid),
        "sampling": dataclasses.asdict(bundle.sampling),
        "text_encoder": spec,
        "components": {"target": "target", "vq": "vq", "drafter": "drafter" if bundle.drafter is not None else None},
    }
    (path / "bundle.json").write_text(json.dumps(meta, indent=2))
    _save_component(bundle.target, bundle.target.config, path / "target", dtype)
    _save_component(bundle.vq, bundle.vq.cfg, path / "vq", dtype)
    if bundle.drafter is not None:
        _save_component(bundle.drafter, bundle.drafter.config, path / "drafter", dtype)
    return path


def _load_component(cls, cfg_cls, path: Path):
    raw = json.loads((path / "config.json").read_text())
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(f"{path / 'config.json'}: unknown fields {sorted(unknown)}")
    cfg = cfg_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    module = cls(cfg)
    state = load_file(str(path / "model.safetensors"))
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"{path}: missing keys {missing[:10]}, unexpected keys {extra[:10]}")
    for k, v in state.items():
        if v.shape != own[k].shape:
            raise ValueError(f"{path}: key {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return module.eval()


def resolve_bundle_dir(name_or_path: str | Path) -> Path:
    """A bundle directory, an embedded bundle, or a manifest file (see bundles/manifest.py)."""
    p = Path(name_or_path)
    if p.is_dir():
        return p
    if p.suffix.lower() in (".yaml", ".yml", ".json") and p.is_file():
        return p
    embedded = EMBEDDED_DIR / str(name_or_path)
    if embedded.is_dir():
        return embedded
    known = sorted(d.name for d in EMBEDDED_DIR.iterdir() if d.is_dir()) if EMBEDDED_DIR.is_dir() else []
    raise FileNotFoundError(f"no bundle directory {str(name_or_path)!r}; embedded bundles: {known}")


def load_bundle_dir(name_or_path: str | Path = DEFAULT_BUNDLE) -> Bundle:
    """Load a bundle directory or an embedded bundle by name (default: emoji16). Manifests
    build on this module: `adt_core.load_bundle` (bundles/loader.py) loads either."""
    path = resolve_bundle_dir(name_or_path)
    if path.is_file():
        raise ValueError(f"{path} is a manifest, not a bundle directory: load it with adt_core.load_bundle")
    meta = json.loads((path / "bundle.json").read_text())
    if meta.get("family", "llamagen") != "llamagen":
        raise ValueError(f"{path} holds a {meta['family']!r} bundle: load it with adt_core.load_bundle")
    comps = meta["components"]
    target = _load_component(LlamaGenGPT, GPTConfig, path / comps["target"])
    vq = _load_component(VQModel, VQConfig, path / comps["vq"])
    drafter = _load_component(Drafter, DrafterConfig, path / comps["drafter"]) if comps.get("drafter") else None
    return Bundle(
        name=meta["name"],
        text_encoder=build_text_encoder(meta["text_encoder"]),
        target=target,
        drafter=drafter,
        vq=vq,
        grid=tuple(meta["grid"]),
        sampling=SamplingConfig(**meta["sampling"]),
    )
