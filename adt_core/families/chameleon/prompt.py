"""Chameleon prompts: the model's own tokenizer and the Lumina-mGPT / Anole layouts.

Tokenizer: a `tokenizers` JSON file, the checkpoint's tokenizer.json (HF) or Meta's
text_tokenizer.json (read through adt_core/families/text.py); special ids are looked up by
name, never assumed:

    <s> BOS   <racm3:break> image start   <eoss> image end   <reserved08706> end of turn
    <reserved08799> end of line (Lumina)   <reserved{08800 + n}> Lumina size token for n patches
    IMGIMG<digits as letters A-J>Z  image code tokens (code = id - first id; checked contiguous)

Lumina-mGPT (Alpha-VLLM/Lumina-mGPT, inference + item processor):
    cond   = BOS + "Generate an image of {W}x{H} according to the following prompt:\\n{prompt}"
             + end-of-turn + [image start, size(H / 32), size(W / 32)]
    uncond = [image start, size(H / 32), size(W / 32)]  (no text: its own, shorter row)
    image  = H/16 rows of W/16 codes, each row followed by end-of-line; then image end.
    Sizes: multiples of 32 px from the model's training crop list (patch budget (trained/32)^2,
    aspect ratio <= 4), e.g. 768x768, 1024x576 for the 768 model.
Anole (LANTERN / ADT-Tree scripts):
    cond   = BOS + prompt + end-of-turn + image start;  uncond = BOS + image start
    image  = 32 x 32 codes (512 px), then a forced image end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from adt_core.families.contract import ImageVocab, Layout, PromptRows
from adt_core.families.text import TextTokenizer, id_rows, read_tokenizer, tokenizer_file

LUMINA_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
PATCH_PX = 32  # a Lumina size token counts 32 px patches (2 codes)
DOWNSAMPLE = 16  # pixels per code side (the Chameleon VQGAN)
MAX_RATIO = 4.0  # Lumina's training crops: longest / shortest side
ANOLE_PX = 512
MAX_PROMPT = 512  # prompt entries per row by default (the engine's own default bound)
TOKENIZER_FILES = ("tokenizer.json", "text_tokenizer.json", "tokenizer/text_tokenizer.json")
NAMES = {"bos": "<s>", "pad": "<pad>", "image_start": "<racm3:break>", "image_end": "<eoss>",
         "end_of_turn": "<reserved08706>", "end_of_line": "<reserved08799>"}


def size_token_name(patches: int) -> str:
    return f"<reserved{8800 + patches:05d}>"


def image_code_of(name: str) -> int | None:
    """Code of an image token name IMGIMG<letters>Z (A..J = digits 0..9), else None."""
    if not name.startswith("IMGIMG") or len(name) < 8:
        return None
    digits = name[6:-1]
    if not all("A" <= c <= "J" for c in digits):
        return None
    return int("".join(str(ord(c) - ord("A")) for c in digits))


class ChameleonTokenizer(TextTokenizer):
    """The checkpoint's tokenizer with Chameleon's special ids and its image vocabulary."""

    def __init__(self, tokenizer, source: str = "tokenizer") -> None:
        super().__init__(tokenizer, NAMES, source, kind="Chameleon")
        self.vocab = self._image_vocab()

    def size_token(self, patches: int) -> int:
        return self.id_of(size_token_name(patches))

    def _image_vocab(self) -> ImageVocab:
        pairs = [(c, i) for name, i in self.tokens().items() if (c := image_code_of(name)) is not None]
        if not pairs:
            raise ValueError(f"{self.source}: no IMGIMG image tokens")
        pairs.sort()
        first = pairs[0][1] - pairs[0][0]
        if any(c != k or i - c != first for k, (c, i) in enumerate(pairs)):
            raise ValueError(f"{self.source}: image tokens are not contiguous ids with code = id - {first}")
        return ImageVocab(first, len(pairs), max(self.tok.get_vocab_size(with_added_tokens=True), first + len(pairs)))


def load_tokenizer(path: str | Path) -> ChameleonTokenizer:
    """A tokenizer JSON file, or a directory holding tokenizer.json / text_tokenizer.json /
    tokenizer/text_tokenizer.json (first found)."""
    p = tokenizer_file(path, TOKENIZER_FILES)
    return ChameleonTokenizer(read_tokenizer(p), str(p))


# ---- sizes --------------------------------------------------------------------------------
def lumina_sizes(trained_px: int, max_ratio: float = MAX_RATIO) -> list[tuple[int, int]]:
    """(width, height) px of Lumina-mGPT's training crops for a model trained at trained_px:
    with n = (trained_px / 32)^2 patches, w patches wide and h high where
    max(1, n // (w + 1)) <= h <= n // w and the aspect ratio is at most max_ratio."""
    n = (trained_px // PATCH_PX) ** 2
    sizes = []
    for w in range(n, 0, -1):
        for h in range(max(1, n // (w + 1)), n // w + 1):
            if max(w, h) / min(w, h) <= max_ratio:
                sizes.append((w * PATCH_PX, h * PATCH_PX))
    return sizes


def check_lumina_size(width: int, height: int, trained_px: int) -> None:
    if width % PATCH_PX or height % PATCH_PX or width <= 0 or height <= 0:
        raise ValueError(f"Lumina image size {width}x{height}: both sides must be positive multiples of {PATCH_PX}")
    allowed = lumina_sizes(trained_px)
    if (width, height) not in allowed:
        near = sorted(allowed, key=lambda s: abs(s[0] / s[1] - width / height) + abs(s[0] * s[1] - width * height)
                      / (trained_px**2))[:4]
        raise ValueError(f"Lumina image size {width}x{height} is not one the {trained_px}-px model was trained on "
                         f"(aspect <= {MAX_RATIO:g}, {(trained_px // PATCH_PX) ** 2} patches); closest: "
                         + ", ".join(f"{w}x{h}" for w, h in near))


# ---- prompters ----------------------------------------------------------------------------
@dataclass
class LuminaPrompter:
    """Lumina-mGPT prompts at width x height px (W codes = width / 16 per image row)."""

    tokenizer: ChameleonTokenizer
    width: int = 768
    height: int = 768
    trained_px: int = 768  # the checkpoint's training size (Lumina-mGPT-7B-768: 768)
    check_size: bool = True  # refuse sizes outside the training crop list
    max_prompt: int = MAX_PROMPT  # prompt entries a row may hold (the decoder's cache and memory plan)
    layout: Layout = field(init=False)
    vocab: ImageVocab = field(init=False)

    def __post_init__(self) -> None:
        if self.check_size:
            check_lumina_size(self.width, self.height, self.trained_px)
        ids = self.tokenizer.ids
        head = (ids["image_start"], self.tokenizer.size_token(self.height // PATCH_PX),
                self.tokenizer.size_token(self.width // PATCH_PX))
        self.layout = Layout(self.height // DOWNSAMPLE, self.width // DOWNSAMPLE, head=head,
                             eol=ids["end_of_line"], end=ids["image_end"])
        self.vocab = self.tokenizer.vocab

    def text(self, prompt: str) -> str:
        return LUMINA_TEMPLATE.format(width=self.width, height=self.height, prompt=prompt)

    def cond_ids(self, prompt: str) -> list[int]:
        ids = self.tokenizer.ids
        return [ids["bos"], *self.tokenizer.encode(self.text(prompt)), ids["end_of_turn"], *self.layout.head]

    def uncond_ids(self) -> list[int]:
        return list(self.layout.head)

    @property
    def typical_prompt(self) -> int:
        """A typical prompt row: a quarter of the longest (the cost table's mid-image state)."""
        return self.max_prompt // 4

    def rows(self, prompts: Sequence[str], cfg: bool) -> PromptRows:
        return _rows(self, prompts, cfg)


@dataclass
class AnolePrompter:
    """Anole prompts: 512 px, 32 x 32 codes, no size or end-of-line tokens."""

    tokenizer: ChameleonTokenizer
    max_prompt: int = MAX_PROMPT  # prompt entries a row may hold (the decoder's cache and memory plan)
    layout: Layout = field(init=False)
    vocab: ImageVocab = field(init=False)

    def __post_init__(self) -> None:
        side = ANOLE_PX // DOWNSAMPLE
        ids = self.tokenizer.ids
        self.layout = Layout(side, side, head=(ids["image_start"],), eol=None, end=ids["image_end"])
        self.vocab = self.tokenizer.vocab

    def cond_ids(self, prompt: str) -> list[int]:
        ids = self.tokenizer.ids
        return [ids["bos"], *self.tokenizer.encode(prompt), ids["end_of_turn"], *self.layout.head]

    def uncond_ids(self) -> list[int]:
        return [self.tokenizer.ids["bos"], *self.layout.head]

    @property
    def typical_prompt(self) -> int:
        """A typical prompt row: a quarter of the longest (the cost table's mid-image state)."""
        return self.max_prompt // 4

    def rows(self, prompts: Sequence[str], cfg: bool) -> PromptRows:
        return _rows(self, prompts, cfg)


def _rows(prompter, prompts: Sequence[str], cfg: bool) -> PromptRows:
    return id_rows([prompter.cond_ids(p) for p in prompts], lambda _: prompter.uncond_ids(), cfg,
                   prompter.max_prompt, prompter.tokenizer.ids["pad"])


def load_prompter(path: str | Path, layout: str = "lumina", width: int | None = None, height: int | None = None,
                  trained_px: int = 768, check_size: bool = True,
                  max_prompt: int = MAX_PROMPT) -> LuminaPrompter | AnolePrompter:
    """A prompter over the tokenizer at `path` (file or checkpoint directory).

    layout "lumina": width / height default to trained_px; "anole": 512 x 512 only. max_prompt:
    the longest prompt row (template and image head included) a decoder holds; longer prompts
    fail alone."""
    tok = load_tokenizer(path)
    if max_prompt < 1:
        raise ValueError(f"max_prompt {max_prompt} < 1")
    if layout == "lumina":
        return LuminaPrompter(tok, width or trained_px, height or trained_px, trained_px, check_size, max_prompt)
    if layout == "anole":
        if (width or ANOLE_PX, height or ANOLE_PX) != (ANOLE_PX, ANOLE_PX):
            raise ValueError(f"Anole generates {ANOLE_PX}x{ANOLE_PX} images only, not {width}x{height}")
        return AnolePrompter(tok, max_prompt)
    raise ValueError(f"unknown Chameleon layout {layout!r} (lumina or anole)")
