"""Janus-Pro prompts: DeepSeek's chat template, the model's own tokenizer, Janus' CFG row.

What deepseek-ai/Janus does for text-to-image (README / generation_inference.py, with
VLChatProcessor and the "deepseek" conversation template, empty system prompt):

    text   = "<|User|>: " + prompt.strip() + "\\n\\n<|Assistant|>:"      (then .strip())
    cond   = BOS + tokens(text) + <begin_of_image>
    uncond = the same length: BOS, then <｜▁pad▁｜> at every position but the last, <begin_of_image>
    image  = 576 codes (24 x 24, 384 px at 16 px per code), no syntax tokens, nothing after them

The uncond row is NOT masked: Janus runs it without an attention mask, so every pad is
attended (transformers' JanusForConditionalGeneration.generate does the same). CFG mixes
uncond + 5 (cond - uncond); T 1; no top-k or top-p (`JANUS_SAMPLING`).

Tokenizer: the checkpoint's tokenizer.json (adt_core/families/text.py); special ids are
looked up by name (BOS from special_tokens_map.json / tokenizer_config.json when present beside it; a special
token only tokenizer_config.json's added_tokens_decoder declares is found there). "<|User|>"
and "<|Assistant|>" are plain text to DeepSeek's tokenizer. Ids: image code c is id T + c, T =
the language model's text vocabulary (config.json), the target's `ImageVocab`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from adt_core.families.contract import ImageVocab, Layout, PromptRows
from adt_core.families.text import TextTokenizer, id_rows, read_tokenizer, tokenizer_file

TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
NAMES = {"bos": "<｜begin▁of▁sentence｜>", "pad": "<｜▁pad▁｜>", "image_start": "<begin_of_image>"}
IMAGE_PX = 384
DOWNSAMPLE = 16  # pixels per code side (VQ-16)
GRID = IMAGE_PX // DOWNSAMPLE  # 24
NUM_CODES = 16384
TEXT_VOCAB = 102400  # DeepSeek-LLM's embedding rows (Janus-Pro-1B and -7B)
JANUS_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 5.0}
MAX_PROMPT = 512  # prompt ids a row may hold by default (the engine's own default bound)
TOKENIZER_FILES = ("tokenizer.json",)


def _special_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(f: Path) -> dict:
    try:
        obj = json.loads(f.read_text()) if f.is_file() else {}
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _bos_name(directory: Path) -> str:
    """BOS as special_tokens_map.json or tokenizer_config.json names it, else DeepSeek's."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        bos = _special_content(_read_json(directory / name).get("bos_token"))
        if bos:
            return bos
    return NAMES["bos"]


def _added_tokens(directory: Path) -> dict[str, int]:
    """name -> id of tokenizer_config.json's added_tokens_decoder (special ids some checkpoints
    declare there and not in tokenizer.json)."""
    out = {}
    for i, spec in (_read_json(directory / "tokenizer_config.json").get("added_tokens_decoder") or {}).items():
        name = _special_content(spec)
        if name is not None and str(i).isdigit():
            out[name] = int(i)
    return out


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """tokenizer.json, or a directory holding it."""
    p = tokenizer_file(path, TOKENIZER_FILES)
    names = {**NAMES, "bos": _bos_name(p.parent)}
    return TextTokenizer(read_tokenizer(p), names, str(p), _added_tokens(p.parent), kind="Janus / DeepSeek")


def vocab_from_config(path: str | Path) -> ImageVocab | None:
    """The target's ImageVocab from a checkpoint's config.json (either layout), else None."""
    f = Path(path) / "config.json" if Path(path).is_dir() else Path(path).parent / "config.json"
    if not f.is_file():
        return None
    c = json.loads(f.read_text())
    if "language_config" in c:
        t = int(c["language_config"]["vocab_size"])
        v = int(c.get("gen_vision_config", {}).get("params", {}).get("image_token_size", NUM_CODES))
    elif "text_config" in c:
        t = int(c["text_config"]["vocab_size"])
        v = int((c.get("vq_config") or {}).get("num_embeddings", NUM_CODES))
    else:
        return None
    return ImageVocab(t, v, t + v)


@dataclass
class JanusPrompter:
    """Janus-Pro prompts for a grid x grid image (24: 384 px)."""

    tokenizer: TextTokenizer
    vocab: ImageVocab = field(default_factory=lambda: ImageVocab(TEXT_VOCAB, NUM_CODES, TEXT_VOCAB + NUM_CODES))
    grid: int = GRID
    max_prompt: int = MAX_PROMPT  # prompt ids a row may hold (the decoder's cache and memory plan)
    layout: Layout = field(init=False)

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise ValueError(f"grid {self.grid} < 1")
        if self.tokenizer.size > self.vocab.first_id:
            raise ValueError(f"{self.tokenizer.source}: {self.tokenizer.size} token ids overlap the image ids "
                             f"from {self.vocab.first_id} (text vocabulary of the target)")
        self.layout = Layout(self.grid, self.grid, head=(self.tokenizer.ids["image_start"],))

    def text(self, prompt: str) -> str:
        return TEMPLATE.format(prompt=prompt.strip()).strip()

    def cond_ids(self, prompt: str) -> list[int]:
        return [self.tokenizer.ids["bos"], *self.tokenizer.encode(self.text(prompt)), *self.layout.head]

    def uncond_ids(self, cond: Sequence[int]) -> list[int]:
        """Janus' unconditional row for a cond row: BOS and image start kept, pads between."""
        ids = self.tokenizer.ids
        return [ids["bos"], *[ids["pad"]] * (len(cond) - 1 - len(self.layout.head)), *self.layout.head]

    @property
    def typical_prompt(self) -> int:
        """A typical prompt row: a quarter of the longest (the cost table's mid-image state)."""
        return self.max_prompt // 4

    def rows(self, prompts: Sequence[str], cfg: bool) -> PromptRows:
        """Cond rows, then (cfg) uncond rows of the same lengths; every entry valid (attended)."""
        return id_rows([self.cond_ids(p) for p in prompts], self.uncond_ids, cfg, self.max_prompt,
                       self.tokenizer.ids["pad"])


def load_prompter(path: str | Path, grid: int = GRID, vocab: ImageVocab | None = None,
                  max_prompt: int = MAX_PROMPT) -> JanusPrompter:
    """A prompter over the tokenizer at `path` (tokenizer.json or a checkpoint directory); the
    image ids come from the checkpoint's config.json beside it, else `vocab`, else Janus-Pro's.
    A prompt longer than `max_prompt` ids (template included) is refused (that prompt fails)."""
    tok = load_tokenizer(path)
    vocab = vocab or vocab_from_config(path)
    if vocab is None:
        return JanusPrompter(tok, grid=grid, max_prompt=max_prompt)
    return JanusPrompter(tok, vocab, grid, max_prompt)
