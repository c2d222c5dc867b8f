"""FLAN-T5 caption encoder, handled the way LlamaGen handles it for text-to-image.

LlamaGen (language/t5.py, autoregressive/sample/sample_t2i.py) does, per batch of prompts:

1. clean each caption twice with its training-time cleaner (`clean_caption` below);
2. tokenize to exactly `max_tokens` (120) ids: padding to max length, truncation, EOS added;
3. run the T5 encoder (bf16) with the attention mask and take the last hidden states;
4. move the n valid rows to the END of the 120 rows, zero the padding rows and flip the mask.

`T5TextEncoder.encode` returns `(emb (B, 120, d_model) float32, mask (B, 120) bool)`, the
contract of adt_core/families/llamagen/text_encoder.py. The model and tokenizer come from a local directory
(e.g. google/flan-t5-xl as downloaded); nothing is fetched.

Cleaning uses what LlamaGen's cleaner uses: BeautifulSoup ("html.parser") to strip HTML and
`ftfy.fix_text`; both come with `pip install 'adt-tree[t5]'` (and in the Docker image). Without
them a fallback runs (the standard library's HTML parser, and the part of ftfy's defaults that
matters for prompts), which matches them on ordinary prompts but not on everything (ftfy's
mojibake repair has no fallback), so the first caption cleaned without one logs a warning
naming the package and the install command.
"""

from __future__ import annotations

import functools
import html
import importlib
import logging
import re
import unicodedata
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---- LlamaGen's caption cleaning (a PixArt / DeepFloyd-IF heritage) ----------------------
_URL_TLDS = r"(?:com|co|ru|net|org|edu|gov|it)"
# Two URL shapes, each with or without a scheme: "http:..." / "www:..." or "<host>.<tld>/path".
_URL_HTTP = re.compile(r"\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.]" + _URL_TLDS + r"[\w/-]*\b\/?(?!@)))")
_URL_WWW = re.compile(r"\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.]" + _URL_TLDS + r"[\w/-]*\b\/?(?!@)))")
# CJK blocks dropped: strokes, katakana ext., enclosed, compatibility, ext. A, hexagrams, unified.
_CJK = [(0x31C0, 0x31EF), (0x31F0, 0x31FF), (0x3200, 0x32FF), (0x3300, 0x33FF), (0x3400, 0x4DBF),
        (0x4DC0, 0x4DFF), (0x4E00, 0x9FFF)]
# Every dash-like code point becomes "-".
_DASHES = ("\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40\u301C\u3030\u30A0"
           "\uFE31\uFE32\uFE58\uFE63\uFF0D")
# Runs of these punctuation marks become one space.
_BAD_PUNCT = re.compile("[" + re.escape("#®•©™&@·º½¾¿¡§~)(][}{|\\/*") + "]{1,}")
_FILE_EXT = r"(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)"

# (pattern, replacement) applied in order after lower-casing and URL / HTML stripping.
_RULES_BEFORE_FIX: list[tuple[re.Pattern, str]] = [
    (re.compile(r"@[\w\d]+\b"), ""),  # @nickname
    *[(re.compile(f"[{chr(a)}-{chr(b)}]+"), "") for a, b in _CJK],
    (re.compile(f"[{_DASHES}]+"), "-"),
    (re.compile("[`´«»“”¨]"), '"'),  # quotes to one standard
    (re.compile("[‘’]"), "'"),
    (re.compile(r"&quot;?"), ""),
    (re.compile(r"&amp"), ""),
    (re.compile(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}"), " "),  # IP addresses
    (re.compile(r"\d:\d\d\s+$"), ""),  # trailing article ids
    (re.compile(r"\\n"), " "),  # literal backslash-n
    (re.compile(r"#\d{1,3}\b"), ""),
    (re.compile(r"#\d{5,}\b"), ""),
    (re.compile(r"\b\d{6,}\b"), ""),
    (re.compile(r"[\S]+\." + _FILE_EXT), ""),  # file names
    (re.compile(r"[\"\']{2,}"), '"'),
    (re.compile(r"[\.]{2,}"), " "),
    (_BAD_PUNCT, " "),
    (re.compile(r"\s+\.\s+"), " "),
]
_SEPARATORS = re.compile(r"(?:\-|\_)")  # this-is-my-cute-cat: more than 3 -> spaces
_RULES_AFTER_FIX: list[tuple[re.Pattern, str]] = [
    (re.compile(r"\b[a-zA-Z]{1,3}\d{3,15}\b"), ""),  # product codes: jc6640
    (re.compile(r"\b[a-zA-Z]+\d+[a-zA-Z]+\b"), ""),  # jc6640vc
    (re.compile(r"\b\d+[a-zA-Z]+\d+\b"), ""),  # 6640vc231
    (re.compile(r"(worldwide\s+)?(free\s+)?shipping"), ""),
    (re.compile(r"(free\s)?download(\sfree)?"), ""),
    (re.compile(r"\bclick\b\s(?:for|on)\s\w+"), ""),
    (re.compile(r"\b" + _FILE_EXT + r"(\simage[s]?)?"), ""),
    (re.compile(r"\bpage\s+\d+\b"), ""),
    (re.compile(r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b"), " "),  # j2d1a2a...
    (re.compile(r"\b\d+\.?\d*[xх×]\d+\.?\d*\b"), ""),  # sizes: 1920x1080
    (re.compile(r"\b\s+\:\s+"), ": "),
    (re.compile(r"(\D[,\./])\b"), r"\1 "),
    (re.compile(r"\s+"), " "),
    (re.compile(r"^[\"\']([\w\W]+)[\"\']$"), r"\1"),  # surrounding quotes
    (re.compile(r"^[\'\_,\-\:;]"), ""),
    (re.compile(r"[\'\_,\-\:\-\+]$"), ""),
    (re.compile(r"^\.\S+$"), ""),
]


INSTALL_HINT = "pip install 'adt-tree[t5]'"


@functools.lru_cache(maxsize=None)
def _optional(module: str, package: str):
    """The module, or None after one warning (per process) naming the package and the install command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        log.warning("%s is not installed: FLAN-T5 captions are cleaned with a fallback that can differ "
                    "from LlamaGen's cleaner; install it with: %s (or pip install %s)",
                    package, INSTALL_HINT, package)
        return None


class _TextOnly(HTMLParser):
    """The text of an HTML fragment as BeautifulSoup's .text gives it: tags dropped, entities
    decoded, CDATA kept, <script> / <style> contents dropped."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0  # inside <script> or <style>

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in ("script", "style"):
            self.hidden += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self.hidden:
            self.hidden -= 1

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)

    def unknown_decl(self, data: str) -> None:
        if data.upper().startswith("CDATA["):  # captions are lower-cased before this
            self.parts.append(data[len("CDATA["):])


def strip_html(text: str) -> str:
    """BeautifulSoup(text, "html.parser").text (LlamaGen's call), or the fallback parser."""
    bs4 = _optional("bs4", "beautifulsoup4")
    if bs4 is not None:
        return bs4.BeautifulSoup(text, features="html.parser").text
    p = _TextOnly()
    p.feed(text)
    p.close()
    return "".join(p.parts)


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufeff]")  # ftfy keeps zero-width spaces
_TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LINE_BREAKS = re.compile(r"\r\n|[\r\u2028\u2029\x85]")
_LIGATURES = re.compile("[\u0132\u0133\u01c4-\u01cc\u01f1-\u01f3\ufb00-\ufb06]")


def fix_text(text: str) -> str:
    """ftfy.fix_text (LlamaGen's call); without ftfy, the subset of its defaults that matters for
    prompts: terminal escapes, HTML entities, ligatures, full-width forms, curly quotes, line
    breaks and control characters, then NFC."""
    ftfy = _optional("ftfy", "ftfy")
    if ftfy is not None:
        return ftfy.fix_text(text)
    text = _TERMINAL_ESCAPE.sub("", text)
    if "&" in text and "<" not in text:
        text = html.unescape(text)
    text = _LIGATURES.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text)
    text = "".join(chr(ord(c) - 0xFEE0) if 0xFF01 <= ord(c) <= 0xFF5E else (" " if c == "\u3000" else c) for c in text)
    text = re.sub("[\u2018\u2019\u201a\u201b]", "'", re.sub("[\u201c\u201d\u201e\u201f]", '"', text))
    text = _LINE_BREAKS.sub("\n", text)
    text = _CONTROL.sub("", text)
    return unicodedata.normalize("NFC", text)


def clean_caption(caption: str) -> str:
    """One pass of LlamaGen's caption cleaner (lower-case, URLs, HTML, handles, CJK, noise)."""
    c = urllib.parse.unquote_plus(str(caption))
    c = c.strip().lower()
    c = re.sub(r"<person>", "person", c)
    c = _URL_HTTP.sub("", c)
    c = _URL_WWW.sub("", c)
    c = strip_html(c)
    for pat, rep in _RULES_BEFORE_FIX:
        c = pat.sub(rep, c)
    if len(_SEPARATORS.findall(c)) > 3:
        c = _SEPARATORS.sub(" ", c)
    c = html.unescape(html.unescape(fix_text(c))).strip()  # LlamaGen's basic_clean
    for pat, rep in _RULES_AFTER_FIX:
        c = pat.sub(rep, c)
    return c.strip()


def preprocess_caption(caption: str, clean: bool = True) -> str:
    """LlamaGen's text preprocessing: the cleaner applied twice, or just lower + strip."""
    if not clean:
        return str(caption).lower().strip()
    return clean_caption(clean_caption(caption))


def right_align(states: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaGen's left padding: (B, T, C) states with right padding (valid (B, T) True on a
    prefix of n_b rows) -> rows rotated so the n_b valid rows come last, padding rows zeroed;
    returns (emb (B, T, C), mask (B, T)) with the mask flipped accordingly."""
    b, t, _ = states.shape
    n = valid.sum(1)  # (B,)
    rows = []
    for i in range(b):
        k = int(n[i])
        rows.append(torch.cat([states[i, k:], states[i, :k]]))  # valid rows moved to the end
    mask = valid.flip(-1)  # (B, T) True on the last n_b rows
    emb = torch.stack(rows) * mask[..., None].to(states.dtype)
    return emb, mask


def _auto_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class T5TextEncoder(nn.Module):
    """prompts -> (emb (B, max_tokens, d_model) float32, mask (B, max_tokens) bool).

    path: a local directory holding a T5 (encoder) checkpoint and its tokenizer, e.g.
        google/flan-t5-xl (config.json, model-*.safetensors, tokenizer.json / spiece.model).
    dtype: "bfloat16" (LlamaGen's default), "float32"; "float16" overflows in T5 and is refused.
    device: "auto" = cuda when available, else cpu.
    clean: apply LlamaGen's caption cleaning (its default); False = lower-case + strip only.
    """

    kind = "t5"

    def __init__(self, path: str | Path, max_tokens: int = 120, dtype: str = "bfloat16",
                 device: str = "auto", clean: bool = True) -> None:
        super().__init__()
        from transformers import AutoTokenizer, T5EncoderModel

        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"T5 dtype must be float32 or bfloat16 (fp16 overflows in T5), got {dtype!r}")
        p = Path(path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"T5 directory {p} has no config.json (expected a local flan-t5-xl download)")
        self.path, self.max_tokens, self.clean = str(path), int(max_tokens), bool(clean)
        if self.clean:  # a missing cleaner package is named when the encoder loads
            _optional("bs4", "beautifulsoup4")
            _optional("ftfy", "ftfy")
        self.dtype_name, self.device_name = dtype, str(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        self.model = T5EncoderModel.from_pretrained(str(p), local_files_only=True, dtype=DTYPES[dtype]).eval()
        self.model.requires_grad_(False)
        self.dim = int(self.model.config.d_model)  # 2048 for flan-t5-xl
        self.model.to(_auto_device(device))

    def config(self) -> dict:
        return {"type": self.kind, "path": self.path, "max_tokens": self.max_tokens, "dtype": self.dtype_name,
                "device": self.device_name, "clean": self.clean}

    def train(self, mode: bool = True) -> "T5TextEncoder":
        return super().train(False)  # always eval: no dropout

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts -> (ids (B, T) long, valid (B, T) bool), right-padded to T = max_tokens."""
        texts = [preprocess_caption(p, self.clean) for p in prompts]
        tok = self.tokenizer(texts, max_length=self.max_tokens, padding="max_length", truncation=True,
                             return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
        return tok["input_ids"], tok["attention_mask"].bool()

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if not prompts:
            return torch.zeros(0, self.max_tokens, self.dim), torch.zeros(0, self.max_tokens, dtype=torch.bool)
        ids, valid = self.tokenize(list(prompts))
        dev = self.device
        states = self.model(input_ids=ids.to(dev), attention_mask=valid.to(dev).long()).last_hidden_state
        emb, mask = right_align(states.float().cpu(), valid)
        return emb, mask
